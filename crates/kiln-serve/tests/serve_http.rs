//! kiln-serve over HTTP, end to end on loopback: dynamic batching returns every request
//! exactly its own single-request answer, malformed requests get 400 with a message while the
//! server keeps serving, overload and timeouts get explicit statuses whose counts add up,
//! and shutdown drains in-flight requests.

mod common;

use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    TestServer, concurrent_posts, http, images, infer_body, post_json, tempdir, write_cnn_model,
    write_failing_model, write_model,
};
use kiln_serve::Stages;
use serde_json::{Value, json};

#[test]
fn dynamic_batching_answers_each_request_as_if_alone() {
    check_batching("batching", Stages::staged(1));
}

#[test]
fn inline_stages_batch_and_answer_the_same() {
    check_batching("batching-inline", Stages::inline());
}

/// The default: batch-1 JSON requests (~10 KB) decode in place, larger ones on the stage.
#[test]
fn mixed_stage_placement_batches_and_answers_the_same() {
    check_batching("batching-mixed", Stages::default());
}

/// Concurrent clients with mixed batch sizes against a batched and an unbatched model, with
/// decoding and encoding placed by `stages`.
fn check_batching(name: &str, stages: Stages) {
    let repo = tempdir(name);
    let graph = write_cnn_model(
        &repo,
        "w3",
        "max_batch_size = 16\n[dynamic_batching]\nmax_queue_delay_microseconds = 5000\n",
    );
    write_model(
        &repo,
        "w3_unbatched",
        "backend = \"graph\"\ngraph = \"../w3/model.kgraph\"\nmax_batch_size = 16\n",
    );
    let server = TestServer::start_staged(&repo, kiln_serve::MAX_BODY_BYTES, stages);
    let (clients, per_client) = (8usize, 5usize);
    for model in ["w3", "w3_unbatched"] {
        let answers: Vec<(u64, usize, Value)> = thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|c| {
                    let addr = server.http;
                    s.spawn(move || {
                        (0..per_client)
                            .map(|r| {
                                let seed = (c * 100 + r) as u64;
                                let batch = 1 + (c + r) % 3;
                                let resp = post_json(
                                    addr,
                                    &format!("/v2/models/{model}/infer"),
                                    &infer_body(
                                        "images",
                                        &[batch, 1, 28, 28],
                                        &images(seed, batch),
                                    ),
                                );
                                assert_eq!(
                                    resp.status,
                                    200,
                                    "{}",
                                    String::from_utf8_lossy(&resp.body)
                                );
                                (seed, batch, resp.json())
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(answers.len(), clients * per_client);
        let mut worst = 0f32;
        for (seed, batch, resp) in &answers {
            let reference = common::reference_logits(&graph, &images(*seed, *batch), *batch);
            let outputs = resp["outputs"].as_array().unwrap();
            let logits: Vec<f32> = outputs[0]["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_eq!(outputs[0]["name"], "logits");
            assert_eq!(outputs[0]["shape"], json!([batch, 10]));
            assert_eq!(logits.len(), reference.len());
            for (a, b) in logits.iter().zip(&reference) {
                worst = worst.max((a - b).abs() / b.abs().max(1.0));
            }
            // The label output is the arg-max of this request's own logits.
            let labels: Vec<i64> = outputs[1]["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            for (row, label) in reference.chunks(10).zip(&labels) {
                let best = row
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap()
                    .0;
                assert_eq!(*label, best as i64);
            }
        }
        assert!(
            worst <= 1e-5,
            "{model}: batched logits differ from single-request by {worst}"
        );
        let m = &server.model(model).metrics;
        let requests = (clients * per_client) as u64;
        let executions = m.execution_count.load(Ordering::Relaxed);
        let samples: usize = answers.iter().map(|a| a.1).sum();
        assert_eq!(m.inference_count.load(Ordering::Relaxed), samples as u64);
        if model == "w3" {
            assert!(
                executions < requests,
                "dynamic batching ran {executions} batches for {requests} concurrent requests"
            );
        } else {
            assert_eq!(
                executions, requests,
                "without dynamic batching each request runs alone"
            );
        }
    }
    // The batch-size histogram and counters are in /metrics.
    let metrics = http(server.http, "GET", "/metrics", &[], b"");
    let text = String::from_utf8(metrics.body).unwrap();
    assert!(text.contains("# TYPE kiln_batch_size histogram"), "{text}");
    assert!(text.contains(&format!(
        "kiln_request_success_total{{model=\"w3\"}} {}",
        clients * per_client
    )));
    assert!(text.contains("kiln_batch_size_bucket{model=\"w3_unbatched\",le=\"1\"}"));
}

/// What is sent (name, body, extra headers) and a phrase the 400's message must contain.
type MalformedCase<'a> = (&'a str, Vec<u8>, Vec<(&'a str, String)>, &'a str);

#[test]
fn malformed_requests_get_400_with_a_message_and_the_server_keeps_serving() {
    let repo = tempdir("malformed");
    write_model(
        &repo,
        "id",
        "backend = \"identity\"\ndims = [4]\nmax_batch_size = 8\n",
    );
    write_model(
        &repo,
        "broken",
        "backend = \"identity\"\ndims = [4]\ncolour = \"red\"\n",
    );
    let server = TestServer::start_with(&repo, 4096);
    let path = "/v2/models/id/infer";
    let ok = || infer_body("INPUT0", &[1, 4], &[1.0, 2.0, 3.0, 4.0]);
    let binary_header = json!({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
        "parameters": {"binary_data_size": 16}}]})
    .to_string();
    let cases: Vec<MalformedCase> = vec![
        ("bad JSON", b"{\"inputs\": [".to_vec(), vec![], "not valid JSON"),
        ("not an object", b"[1,2]".to_vec(), vec![], "JSON object"),
        ("no inputs", b"{}".to_vec(), vec![], "no `inputs`"),
        (
            "wrong shape",
            infer_body("INPUT0", &[1, 5], &[0.0; 5]).to_string().into_bytes(),
            vec![],
            "expects [-1, 4]",
        ),
        (
            "wrong datatype",
            json!({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
                .to_string()
                .into_bytes(),
            vec![],
            "datatype INT64",
        ),
        (
            "unsupported datatype",
            json!({"inputs": [{"name": "INPUT0", "datatype": "FP16", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
                .to_string()
                .into_bytes(),
            vec![],
            "FP16",
        ),
        ("missing input", json!({"inputs": []}).to_string().into_bytes(), vec![], "missing input `INPUT0`"),
        (
            "unknown input",
            infer_body("pixels", &[1, 4], &[0.0; 4]).to_string().into_bytes(),
            vec![],
            "unexpected input `pixels`",
        ),
        (
            "too few elements",
            infer_body("INPUT0", &[2, 4], &[0.0; 5]).to_string().into_bytes(),
            vec![],
            "carries 5 elements",
        ),
        (
            "batch too large",
            infer_body("INPUT0", &[9, 4], &[0.0; 36]).to_string().into_bytes(),
            vec![],
            "1..=8",
        ),
        (
            "non-numeric data",
            json!({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, "x", 3, 4]}]})
                .to_string()
                .into_bytes(),
            vec![],
            "arrays of FP32 numbers",
        ),
        (
            "unknown output",
            json!({"inputs": ok()["inputs"], "outputs": [{"name": "nope"}]}).to_string().into_bytes(),
            vec![],
            "unknown output `nope`",
        ),
        ("oversized body", vec![b' '; 10_000], vec![], "exceeds the server's limit of 4096 bytes"),
        (
            "negative timeout",
            json!({"parameters": {"timeout": -1}, "inputs": ok()["inputs"]})
                .to_string()
                .into_bytes(),
            vec![],
            "parameter `timeout` must be microseconds",
        ),
        (
            "header length past the body",
            ok().to_string().into_bytes(),
            vec![("Inference-Header-Content-Length", "999".into())],
            "only",
        ),
        (
            "binary size mismatch",
            [binary_header.as_bytes(), &[0u8; 12]].concat(),
            vec![("Inference-Header-Content-Length", binary_header.len().to_string())],
            "declares 16 bytes of binary data but only 12",
        ),
    ];
    for (what, body, headers, expected) in cases {
        let resp = http(server.http, "POST", path, &headers, &body);
        assert_eq!(
            resp.status,
            400,
            "{what}: {}",
            String::from_utf8_lossy(&resp.body)
        );
        let message = resp.error();
        assert!(
            message.contains(expected),
            "{what}: {message:?} lacks {expected:?}"
        );
        // Still serving.
        let good = post_json(server.http, path, &ok());
        assert_eq!(good.status, 200, "after {what}");
    }
    let unknown = post_json(server.http, "/v2/models/nope/infer", &ok());
    assert_eq!(unknown.status, 404);
    assert!(unknown.error().contains("unknown model `nope`"));
    // A model with a bad config is not loaded; its ready endpoint says why; others serve.
    let ready = http(server.http, "GET", "/v2/models/broken/ready", &[], b"");
    assert_eq!(ready.status, 400);
    assert!(
        ready.error().contains("unknown field `colour`"),
        "{}",
        ready.error()
    );
    let index = http(server.http, "POST", "/v2/repository/index", &[], b"").json();
    assert_eq!(index[0]["name"], "broken");
    assert_eq!(index[0]["state"], "UNAVAILABLE");
    assert_eq!(index[1]["state"], "READY");
    assert_eq!(
        http(server.http, "GET", "/v2/health/ready", &[], b"").status,
        200
    );
    let invalid = server.model("id").metrics.failures("invalid");
    assert_eq!(
        invalid, 15,
        "every malformed request that reached the model counted as invalid"
    );
}

#[test]
fn binary_tensor_extension_round_trips() {
    let repo = tempdir("binary");
    write_model(
        &repo,
        "id64",
        "backend = \"identity\"\ndims = [3]\ndatatype = \"INT64\"\n",
    );
    let server = TestServer::start(&repo);
    let values: Vec<i64> = vec![1, -2, i64::MAX, 4, 5, i64::MIN];
    let header = json!({
        "id": "r1",
        "inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [2, 3],
                    "parameters": {"binary_data_size": 48}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    let resp = http(
        server.http,
        "POST",
        "/v2/models/id64/infer",
        &[("Inference-Header-Content-Length", header.len().to_string())],
        &body,
    );
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    let n: usize = resp
        .header("inference-header-content-length")
        .unwrap()
        .parse()
        .unwrap();
    let json: Value = serde_json::from_slice(&resp.body[..n]).unwrap();
    assert_eq!(json["id"], "r1");
    assert_eq!(json["outputs"][0]["parameters"]["binary_data_size"], 48);
    let back: Vec<i64> = resp.body[n..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(back, values);
    // JSON in, JSON out for INT64 too.
    let resp = post_json(
        server.http,
        "/v2/models/id64/infer",
        &json!({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 3], "data": [[7, 8, 9]]}]}),
    );
    assert_eq!(resp.json()["outputs"][0]["data"], json!([7, 8, 9]));
}

#[test]
fn overload_is_rejected_explicitly_and_counts_add_up() {
    let repo = tempdir("overload");
    write_model(
        &repo,
        "slow",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 20000\nmax_queue_size = 2\n",
    );
    write_model(
        &repo,
        "timeout",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 40000\n\
         timeout_microseconds = 10000\n",
    );
    let server = TestServer::start(&repo);
    for (model, n, rejected_status) in [("slow", 30, 429u16), ("timeout", 8, 503)] {
        let bodies = (0..n).map(|i| infer_body("INPUT0", &[1, 1], &[i as f32]));
        let statuses = concurrent_posts(server.http, &format!("/v2/models/{model}/infer"), bodies);
        let ok = statuses.iter().filter(|s| s.0 == 200).count();
        let rejected: Vec<_> = statuses.iter().filter(|s| s.0 == rejected_status).collect();
        assert_eq!(
            ok + rejected.len(),
            n,
            "{model}: every request answered 200 or {rejected_status}: {statuses:?}"
        );
        assert!(
            ok >= 1 && !rejected.is_empty(),
            "{model}: {ok} ok, {} rejected",
            rejected.len()
        );
        let m = &server.model(model).metrics;
        let reason = if model == "slow" {
            "queue_full"
        } else {
            "timeout"
        };
        assert!(rejected[0].1.contains(if model == "slow" {
            "queue is full"
        } else {
            "timed out"
        }));
        assert_eq!(m.failures(reason), rejected.len() as u64);
        assert_eq!(m.success.load(Ordering::Relaxed), ok as u64);
        assert_eq!(m.inflight.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn a_requests_own_timeout_parameter_applies() {
    let repo = tempdir("request-timeout");
    write_model(
        &repo,
        "slow",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 40000\n",
    );
    let server = TestServer::start(&repo);
    let body = |i: usize, timeout: Option<u64>| {
        let mut b = infer_body("INPUT0", &[1, 1], &[i as f32]);
        if let Some(t) = timeout {
            b["parameters"] = json!({ "timeout": t });
        }
        b
    };
    let path = "/v2/models/slow/infer";
    let statuses = concurrent_posts(server.http, path, (0..6).map(|i| body(i, Some(10_000))));
    let timed_out: Vec<_> = statuses.iter().filter(|s| s.0 == 503).collect();
    let ok = statuses.iter().filter(|s| s.0 == 200).count();
    assert_eq!(ok + timed_out.len(), 6, "{statuses:?}");
    assert!(!timed_out.is_empty(), "{statuses:?}");
    assert!(
        timed_out[0].1.contains("timeout 10000 µs"),
        "{}",
        timed_out[0].1
    );
    // Without the parameter the model has no timeout: queued requests wait and succeed.
    let statuses: Vec<u16> = concurrent_posts(server.http, path, (0..4).map(|i| body(i, None)))
        .into_iter()
        .map(|(status, _)| status)
        .collect();
    assert_eq!(statuses, vec![200; 4]);
}

#[test]
fn graceful_shutdown_finishes_in_flight_requests() {
    let repo = tempdir("shutdown");
    write_model(
        &repo,
        "slow",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 100000\n",
    );
    let mut server = TestServer::start(&repo);
    let addr = server.http;
    let rt = server.model("slow");
    let clients: Vec<_> = (0..4)
        .map(|i| {
            thread::spawn(move || {
                post_json(
                    addr,
                    "/v2/models/slow/infer",
                    &infer_body("INPUT0", &[1, 1], &[i as f32]),
                )
            })
        })
        .collect();
    let start = Instant::now();
    while rt.metrics.inflight.load(Ordering::Relaxed) < 4 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "requests never arrived"
        );
        thread::sleep(Duration::from_millis(2));
    }
    server.stop();
    for (i, c) in clients.into_iter().enumerate() {
        let r = c.join().unwrap();
        assert_eq!(r.status, 200, "request {i} in flight at shutdown");
        assert_eq!(r.json()["outputs"][0]["data"], json!([i as f32]));
    }
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "still accepting after shutdown"
    );
}

#[test]
fn onnx_files_serve_the_same_answers_as_the_graph_they_were_exported_from() {
    let repo = tempdir("onnx");
    let graph_path = write_cnn_model(&repo, "w3", "");
    let graph = kiln::infer::load_graph(&graph_path).unwrap();
    let onnx_dir = write_model(
        &repo,
        "w3_onnx",
        "backend = \"onnx\"\nfile = \"model.onnx\"\n",
    );
    kiln::infer::onnx_export::export(&graph, &onnx_dir.join("model.onnx")).unwrap();
    let bad_dir = write_model(
        &repo,
        "bad_onnx",
        "backend = \"onnx\"\nfile = \"model.onnx\"\n",
    );
    std::fs::write(bad_dir.join("model.onnx"), b"not a protobuf").unwrap();
    let server = TestServer::start(&repo);
    let x = images(3, 2);
    let answer = |model: &str| {
        let r = post_json(
            server.http,
            &format!("/v2/models/{model}/infer"),
            &infer_body("images", &[2, 1, 28, 28], &x),
        );
        assert_eq!(
            r.status,
            200,
            "{model}: {}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()["outputs"][0]["data"].clone()
    };
    let floats = |v: Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let (graph_logits, onnx_logits) = (floats(answer("w3")), floats(answer("w3_onnx")));
    assert_eq!(graph_logits.len(), onnx_logits.len());
    let scale = graph_logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (a, b) in graph_logits.iter().zip(&onnx_logits) {
        assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
    }
    let ready = http(server.http, "GET", "/v2/models/bad_onnx/ready", &[], b"");
    assert_eq!(ready.status, 400);
    assert!(
        ready.error().contains("not a readable ONNX model"),
        "{}",
        ready.error()
    );
}

/// Exported models from `models/onnx` (PyTorch's exporter) serve over HTTP with dynamic
/// batching: a BERT-style encoder with two INT64 inputs whose sequence axis the config fixes,
/// and a segmentation head whose outputs are maps. Each answer equals the model run alone
/// in-process; a dynamic axis left unfixed is a load error that says what to write.
#[test]
fn exported_onnx_models_serve_multiple_inputs_and_map_outputs() {
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/onnx");
    let repo = tempdir("onnx-exported");
    let batching = "max_batch_size = 8\n[dynamic_batching]\nmax_queue_delay_microseconds = 20000\n";
    let bert = write_model(
        &repo,
        "bert",
        &format!(
            "backend = \"onnx\"\nfile = \"model.onnx\"\ninput_dims = {{ input_ids = [12], attention_mask = [12] }}\n{batching}"
        ),
    );
    std::fs::copy(models.join("bert.onnx"), bert.join("model.onnx")).unwrap();
    let seg = write_model(
        &repo,
        "seg",
        &format!("backend = \"onnx\"\nfile = \"model.onnx\"\n{batching}"),
    );
    std::fs::copy(models.join("seghead.onnx"), seg.join("model.onnx")).unwrap();
    let unfixed = write_model(
        &repo,
        "unfixed",
        "backend = \"onnx\"\nfile = \"model.onnx\"\n",
    );
    std::fs::copy(models.join("bert.onnx"), unfixed.join("model.onnx")).unwrap();
    let server = TestServer::start(&repo);

    let meta = http(server.http, "GET", "/v2/models/bert", &[], b"").json();
    assert_eq!(meta["inputs"][0]["name"], "input_ids");
    assert_eq!(meta["inputs"][1]["datatype"], "INT64");
    assert_eq!(meta["inputs"][1]["shape"], json!([-1, 12]));
    assert_eq!(meta["outputs"][1]["shape"], json!([-1, 12, 32]));

    let device = burn::tensor::Device::flex();
    let local = |file: &str| kiln::onnx::OnnxModel::load(&models.join(file), &device).unwrap();
    let (bert_model, seg_model) = (local("bert.onnx"), local("seghead.onnx"));
    let close = |ours: &Value, want: &[f32]| {
        let ours: Vec<f32> = ours
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(ours.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in ours.iter().zip(want) {
            assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
        }
    };
    // Four clients at once, so the batcher joins their requests.
    let requests: Vec<(Vec<i64>, Vec<i64>)> = (0..4)
        .map(|i| {
            let ids: Vec<i64> = (0..12).map(|t| (t * 7 + i * 13) % 100).collect();
            let mask: Vec<i64> = (0..12).map(|t| i64::from(t < 12 - i)).collect();
            (ids, mask)
        })
        .collect();
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(ids, mask)| {
                s.spawn(move || {
                    let body = json!({"inputs": [
                        {"name": "attention_mask", "datatype": "INT64", "shape": [1, 12], "data": mask},
                        {"name": "input_ids", "datatype": "INT64", "shape": [1, 12], "data": ids},
                    ]});
                    let r = post_json(server.http, "/v2/models/bert/infer", &body);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    r.json()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((ids, mask), answer) in requests.iter().zip(&answers) {
        let want = bert_model
            .run_data(vec![
                burn::tensor::TensorData::new(ids.clone(), [1, 12]),
                burn::tensor::TensorData::new(mask.clone(), [1, 12]),
            ])
            .unwrap();
        for (i, out) in want.into_iter().enumerate() {
            close(
                &answer["outputs"][i]["data"],
                &out.try_to_vec::<f32>().unwrap(),
            );
        }
    }

    let x = images(5, 2)
        .into_iter()
        .cycle()
        .take(2 * 3 * 32 * 32)
        .collect::<Vec<f32>>();
    let r = post_json(
        server.http,
        "/v2/models/seg/infer",
        &infer_body("input", &[2, 3, 32, 32], &x),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let want = seg_model
        .run_data(vec![burn::tensor::TensorData::new(
            x.clone(),
            [2, 3, 32, 32],
        )])
        .unwrap();
    assert_eq!(r.json()["outputs"][0]["shape"], json!([2, 4, 32, 32]));
    for (i, out) in want.into_iter().enumerate() {
        close(
            &r.json()["outputs"][i]["data"],
            &out.try_to_vec::<f32>().unwrap(),
        );
    }

    let ready = http(server.http, "GET", "/v2/models/unfixed/ready", &[], b"");
    assert_eq!(ready.status, 400);
    assert!(ready.error().contains("input_dims"), "{}", ready.error());
}

/// Triton's instance kinds: `KIND_CPU` runs on the CPU and says so in the model's
/// configuration; `KIND_AUTO` resolves on this machine (the CPU without a CUDA build and a
/// driver); `KIND_GPU` runs on the GPU where this kiln has one, and otherwise leaves the
/// model unavailable with a reason that says how to get one, while the others serve.
#[test]
fn instance_kinds_run_where_they_say_or_say_why_not() {
    let repo = tempdir("instance-kinds");
    for (name, kind) in [
        ("cpu", "KIND_CPU"),
        ("auto", "KIND_AUTO"),
        ("gpu", "KIND_GPU"),
    ] {
        write_model(
            &repo,
            name,
            &format!("backend = \"identity\"\ndims = [2]\nkind = \"{kind}\"\n"),
        );
    }
    let server = TestServer::start(&repo);
    let hw = kiln::plan::Hardware::probe();
    let gpu = hw.cuda_compiled && hw.cuda_driver;
    let config = |name: &str| {
        http(
            server.http,
            "GET",
            &format!("/v2/models/{name}/config"),
            &[],
            b"",
        )
    };
    let kind_of = |name: &str| config(name).json()["instance_group"][0]["kind"].clone();
    assert_eq!(kind_of("cpu"), "KIND_CPU");
    assert_eq!(kind_of("auto"), if gpu { "KIND_GPU" } else { "KIND_CPU" });
    let ready = http(server.http, "GET", "/v2/models/gpu/ready", &[], b"");
    if gpu {
        assert_eq!(kind_of("gpu"), "KIND_GPU");
    } else {
        assert_eq!(ready.status, 400);
        let why = ready.error();
        assert!(
            why.contains("kind = \"KIND_GPU\"") && why.contains("--features cuda"),
            "{why}"
        );
    }
    let out = post_json(
        server.http,
        "/v2/models/cpu/infer",
        &infer_body("INPUT0", &[1, 2], &[1.0, 2.0]),
    );
    assert_eq!(out.status, 200, "{}", out.error());
}

/// Server faults from the client side: clients that hang up while their request runs are
/// counted as `cancelled` and leave nothing in flight; a client that sends half a body and
/// disconnects, and one that dribbles its headers, never reach the model; afterwards the
/// server answers as before.
#[test]
fn clients_that_disconnect_or_dawdle_are_cleaned_up_and_counted() {
    use std::io::Write;
    let repo = tempdir("disconnect");
    write_model(
        &repo,
        "slow",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 300000\n",
    );
    let server = TestServer::start(&repo);
    let path = "/v2/models/slow/infer";
    let body = infer_body("INPUT0", &[1, 1], &[1.0]).to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let m = server.model("slow");
    // Hang up while the request runs (the model takes 300 ms).
    let hung_up = 4;
    for _ in 0..hung_up {
        let mut s = std::net::TcpStream::connect(server.http).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        thread::sleep(Duration::from_millis(20));
        drop(s);
    }
    // Half a body, then gone; headers one byte at a time, then gone.
    let mut s = std::net::TcpStream::connect(server.http).unwrap();
    s.write_all(&request.as_bytes()[..request.len() - body.len() / 2])
        .unwrap();
    drop(s);
    let mut s = std::net::TcpStream::connect(server.http).unwrap();
    for b in request.as_bytes()[..20].iter() {
        s.write_all(&[*b]).unwrap();
        thread::sleep(Duration::from_millis(5));
    }
    drop(s);
    // Everything dropped is cleaned up: nothing stays in flight.
    let deadline = Instant::now() + Duration::from_secs(10);
    while (m.metrics.inflight.load(Ordering::Relaxed) > 0
        || m.metrics.failures("cancelled") < hung_up)
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(m.metrics.inflight.load(Ordering::Relaxed), 0);
    assert_eq!(m.metrics.failures("cancelled"), hung_up);
    assert_eq!(
        m.metrics.failures("invalid"),
        0,
        "the half body never reached the model"
    );
    let metrics = http(server.http, "GET", "/metrics", &[], b"");
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(
        text.contains("kiln_request_failure_total{model=\"slow\",reason=\"cancelled\"} 4"),
        "{text}"
    );
    // And it still serves.
    let ok = post_json(server.http, path, &infer_body("INPUT0", &[1, 1], &[2.0]));
    assert_eq!(ok.status, 200, "{}", ok.error());
    assert_eq!(m.metrics.inflight.load(Ordering::Relaxed), 0);
}

/// An instance whose forward fails (`tests/data/fails_above_batch_2.onnx`, written by
/// `tools/make_failing_onnx.py`: y = x + x[0:2], which cannot broadcast for a batch of 3 or
/// more): the failing request gets a 500 that names the model and is counted as `internal`;
/// the instance keeps serving the batches it can run; nothing stays in flight.
#[test]
fn an_instance_whose_forward_fails_answers_500_and_keeps_serving() {
    let repo = tempdir("failing-instance");
    write_failing_model(&repo, "flaky");
    let server = TestServer::start(&repo);
    let path = "/v2/models/flaky/infer";
    let three = post_json(server.http, path, &infer_body("x", &[3, 4], &[1.0; 12]));
    assert_eq!(
        three.status,
        500,
        "{}",
        String::from_utf8_lossy(&three.body)
    );
    assert!(three.error().contains("flaky"), "{}", three.error());
    for _ in 0..3 {
        let two = post_json(server.http, path, &infer_body("x", &[2, 4], &[1.5; 8]));
        assert_eq!(two.status, 200, "{}", two.error());
        assert_eq!(two.json()["outputs"][0]["data"], json!(vec![3.0; 8]));
    }
    let m = server.model("flaky");
    assert_eq!(m.metrics.failures("internal"), 1);
    assert_eq!(m.metrics.success.load(Ordering::Relaxed), 3);
    assert_eq!(m.metrics.inflight.load(Ordering::Relaxed), 0);
}

/// A slow client — it asks for a large answer and never reads it — holds only its own
/// connection: other clients are answered meanwhile, the request leaves the in-flight gauge
/// once answered, and dropping the reader leaves the server serving.
#[test]
fn a_client_that_never_reads_its_answer_holds_up_no_one_else() {
    use std::io::Write;
    let repo = tempdir("slow-reader");
    write_model(&repo, "big", "backend = \"identity\"\ndims = [262144]\n");
    write_model(&repo, "small", "backend = \"identity\"\ndims = [1]\n");
    let server = TestServer::start(&repo);
    // ~1 M floats each way: a response far larger than the socket buffers.
    let body = infer_body("INPUT0", &[1, 262144], &vec![0.25; 262144]).to_string();
    let request = format!(
        "POST /v2/models/big/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut slow = std::net::TcpStream::connect(server.http).unwrap();
    slow.write_all(request.as_bytes()).unwrap();
    // The slow client reads nothing; everyone else is served.
    let started = Instant::now();
    for i in 0..20 {
        let ok = post_json(
            server.http,
            "/v2/models/small/infer",
            &infer_body("INPUT0", &[1, 1], &[i as f32]),
        );
        assert_eq!(ok.status, 200, "{}", ok.error());
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "other clients waited on the slow one"
    );
    let big = server.model("big");
    let deadline = Instant::now() + Duration::from_secs(10);
    while big.metrics.success.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    // Its answer was computed (and is waiting in the socket), not refused or lost.
    assert_eq!(big.metrics.success.load(Ordering::Relaxed), 1);
    assert_eq!(big.metrics.inflight.load(Ordering::Relaxed), 0);
    drop(slow);
    let again = post_json(
        server.http,
        "/v2/models/small/infer",
        &infer_body("INPUT0", &[1, 1], &[7.0]),
    );
    assert_eq!(again.status, 200, "{}", again.error());
}
