//! Stream models over the KServe sequence extension: per-sequence state (regions reused while
//! unchanged), results equal to `kiln::stream` run in-process frame by frame, interleaved
//! sequences batched together, clear 400 / INVALID_ARGUMENT errors for bad sequence use that
//! leave other sequences alone, and idle sequences dropped.

mod common;

use burn::tensor::Device;
use common::{TestServer, post_json, tempdir, write_cnn_model};
use kiln::datasets::{Split, bundled};
use kiln::infer::{Graph, Op, Weight, save_graph};
use kiln::infer::{InferenceSession, load_graph};
use kiln::stream::{
    Cascade, Frame, FrameClassifier, Route, Stage, StreamConfig, StreamProcessor, SyntheticVideo,
    VideoSpec,
};
use kiln_serve::grpc::pb;
use serde_json::{Value, json};

const STREAM: &str = "max_batch_size = 8\ninstances = 1\n\
[dynamic_batching]\nmax_queue_delay_microseconds = 2000\n\
[sequence_batching]\nframe_dims = [1, 56, 56]\n\
regions = [[0, 0, 28, 28], [28, 0, 28, 28], [0, 28, 28, 28], [28, 28, 28, 28]]\n\
region_gate = { threshold = 0.08, max_reuse_age = 30 }\n";

fn frame_body(frame: &Frame, sequence: Value, start: bool, end: bool) -> Value {
    json!({
        "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 56, 56], "data": frame.pixels() }],
        "parameters": { "sequence_id": sequence, "sequence_start": start, "sequence_end": end },
    })
}

/// (labels, confidences, fresh flags) of a response.
fn outputs(r: &Value) -> (Vec<i64>, Vec<f64>, Vec<i64>) {
    let get = |name: &str| -> Vec<Value> {
        r["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["name"] == name)
            .unwrap_or_else(|| panic!("no output {name} in {r}"))["data"]
            .as_array()
            .unwrap()
            .clone()
    };
    (
        get("label").iter().map(|v| v.as_i64().unwrap()).collect(),
        get("confidence")
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect(),
        get("fresh").iter().map(|v| v.as_i64().unwrap()).collect(),
    )
}

fn video(frames: usize, seed: u64) -> SyntheticVideo {
    let digits = bundled(Split::Test).unwrap();
    SyntheticVideo::generate(
        &digits,
        &VideoSpec {
            frames,
            seed,
            ..VideoSpec::default()
        },
    )
    .unwrap()
}

#[test]
fn sequences_keep_state_match_the_library_and_batch_together() {
    let repo = tempdir("stream");
    let graph = write_cnn_model(&repo, "cam", STREAM);
    let server = TestServer::start(&repo);
    let path = "/v2/models/cam/infer";

    let config = server.model("cam").config.clone();
    let stream_config: StreamConfig = config.sequence.clone().unwrap().stream;
    let device = Device::flex();
    let session = InferenceSession::from_graph(load_graph(&graph).unwrap(), &device).unwrap();

    // Two sequences, each from its own thread, frame after frame: every answer equals the
    // library's StreamProcessor over the same frames (labels, fresh flags, confidences).
    let videos = [video(40, 3), video(40, 4)];
    let served: Vec<Vec<Value>> = std::thread::scope(|s| {
        let handles: Vec<_> = videos
            .iter()
            .enumerate()
            .map(|(k, v)| {
                let addr = server.http;
                s.spawn(move || {
                    let n = v.frames.len();
                    v.frames
                        .iter()
                        .enumerate()
                        .map(|(i, f)| {
                            let r = post_json(
                                addr,
                                path,
                                &frame_body(f, json!(k + 1), i == 0, i + 1 == n),
                            );
                            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                            r.json()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut reused = 0;
    for (v, answers) in videos.iter().zip(&served) {
        let mut local = StreamProcessor::new([1, 56, 56], &stream_config, &device).unwrap();
        for (f, answer) in v.frames.iter().zip(answers) {
            let expected = local.process(f, &session).unwrap();
            let (labels, confidences, fresh) = outputs(answer);
            let want: Vec<i64> = expected
                .regions
                .iter()
                .map(|r| r.prediction.class as i64)
                .collect();
            let want_fresh: Vec<i64> = expected
                .regions
                .iter()
                .map(|r| i64::from(r.fresh))
                .collect();
            assert_eq!(labels, want);
            assert_eq!(fresh, want_fresh);
            for (c, r) in confidences.iter().zip(&expected.regions) {
                assert!(
                    (c - f64::from(r.prediction.confidence)).abs() < 1e-4,
                    "{c} vs {r:?}"
                );
            }
            reused += fresh.iter().filter(|&&x| x == 0).count();
        }
    }
    assert!(
        reused > 80,
        "regions reused across the two sequences: {reused} of 320"
    );
    let rt = server.model("cam");
    let [computed, reused_metric] = &rt.metrics.stream_regions;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        load(reused_metric) as usize,
        reused,
        "the metric counts what the answers say"
    );
    assert_eq!(load(computed) as usize + reused, 320);
    // The two sequences' frames shared model executions (dynamic batching across streams).
    assert!(
        load(&rt.metrics.execution_count) < 80,
        "{} executions for 80 frames",
        load(&rt.metrics.execution_count)
    );
    let metrics = common::http(server.http, "GET", "/metrics", &[], b"");
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(&format!(
            "kiln_stream_regions_total{{model=\"cam\",path=\"reused\"}} {reused}"
        )),
        "{text}"
    );

    // Both sequences ended: the table is empty.
    assert_eq!(
        post_json(
            server.http,
            path,
            &frame_body(&videos[0].frames[0], json!(1), false, false)
        )
        .status,
        400
    );
}

#[test]
fn bad_sequence_use_gets_clear_errors_and_other_sequences_go_on() {
    let repo = tempdir("stream-errors");
    write_cnn_model(&repo, "cam", STREAM);
    write_cnn_model(&repo, "plain", "max_batch_size = 8\n");
    write_cnn_model(
        &repo,
        "brief",
        "max_batch_size = 8\n[sequence_batching]\nframe_dims = [1, 28, 28]\nmax_sequence_idle_microseconds = 200000\n",
    );
    write_cnn_model(
        &repo,
        "two",
        "max_batch_size = 8\n[sequence_batching]\nframe_dims = [1, 28, 28]\nmax_active_sequences = 2\n",
    );
    let server = TestServer::start(&repo);
    let path = "/v2/models/cam/infer";
    let v = video(6, 5);
    let f = &v.frames;
    let ok = post_json(
        server.http,
        path,
        &frame_body(&f[0], json!("cam-a"), true, false),
    );
    assert_eq!(ok.status, 200, "{}", ok.error());

    let error = |body: &Value, model: &str| {
        let r = post_json(server.http, &format!("/v2/models/{model}/infer"), body);
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        r.error()
    };
    let no_id = json!({ "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 56, 56], "data": f[1].pixels() }] });
    assert!(error(&no_id, "cam").contains("needs the `sequence_id` parameter"));
    assert!(
        error(&frame_body(&f[1], json!(77), false, false), "cam")
            .contains("sequence 77 of model `cam` is not active")
    );
    assert!(
        error(&frame_body(&f[1], json!("cam-a"), true, false), "cam").contains("already active")
    );
    let small = json!({
        "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28], "data": vec![0.0f32; 784] }],
        "parameters": { "sequence_id": "cam-a" },
    });
    assert!(error(&small, "cam").contains("shape"));
    let pair = [f[1].pixels(), f[2].pixels()].concat();
    let two = json!({
        "inputs": [{ "name": "images", "datatype": "FP32", "shape": [2, 1, 56, 56], "data": pair }],
        "parameters": { "sequence_id": "cam-a" },
    });
    assert!(error(&two, "cam").contains("one frame per request"));
    let flag = json!({
        "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 56, 56], "data": f[1].pixels() }],
        "parameters": { "sequence_id": "cam-a", "sequence_end": "yes" },
    });
    assert!(error(&flag, "cam").contains("`sequence_end` must be a boolean"));
    let mut digit_seq = small.clone();
    digit_seq["parameters"] = json!({ "sequence_id": 5, "sequence_start": true });
    assert!(error(&digit_seq, "plain").contains("not a stream model"));

    // The sequence is unaffected by all of that: it goes on and ends once.
    let r = post_json(
        server.http,
        path,
        &frame_body(&f[1], json!("cam-a"), false, false),
    );
    assert_eq!(r.status, 200, "{}", r.error());
    let r = post_json(
        server.http,
        path,
        &frame_body(&f[2], json!("cam-a"), false, true),
    );
    assert_eq!(r.status, 200, "{}", r.error());
    assert!(error(&frame_body(&f[3], json!("cam-a"), false, true), "cam").contains("has ended"));

    // gRPC says INVALID_ARGUMENT for a sequence never started.
    let addr = format!("http://{}", server.grpc);
    server.runtime.block_on(async {
        let mut c = pb::grpc_inference_service_client::GrpcInferenceServiceClient::connect(addr)
            .await
            .unwrap();
        let mut parameters = std::collections::HashMap::new();
        parameters.insert(
            "sequence_id".to_string(),
            pb::InferParameter {
                parameter_choice: Some(pb::infer_parameter::ParameterChoice::Int64Param(9)),
            },
        );
        let mut request = common::grpc_request(
            "cam",
            "images",
            vec![1, 1, 56, 56],
            common::f32_bytes(f[0].pixels()),
        );
        request.parameters = parameters;
        let status = c.model_infer(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().contains("not active"),
            "{}",
            status.message()
        );
        // The protobuf model configuration says it is a sequence model, as Triton's does.
        let config = common::grpc_model_config(&mut c, "cam").await;
        match config.scheduling_choice {
            Some(pb::model_config::SchedulingChoice::SequenceBatching(s)) => {
                assert_eq!(s.max_sequence_idle_microseconds, 60_000_000)
            }
            other => panic!("no sequence batching in {other:?}"),
        }
    });

    // A sequence idle for longer than its model allows is dropped.
    let digit = json!({
        "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28], "data": vec![0.5f32; 784] }],
        "parameters": { "sequence_id": 1, "sequence_start": true },
    });
    let r = post_json(server.http, "/v2/models/brief/infer", &digit);
    assert_eq!(r.status, 200, "{}", r.error());
    let mut next = digit.clone();
    next["parameters"] = json!({ "sequence_id": 1 });
    let r = post_json(server.http, "/v2/models/brief/infer", &next);
    assert_eq!(
        r.status,
        200,
        "active while requests keep coming: {}",
        r.error()
    );
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert!(error(&next, "brief").contains("not active"));

    // At most max_active_sequences at once: a third start is refused until one ends.
    let digit_frame = |id: u64, start: bool, end: bool| {
        json!({
            "inputs": [{ "name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28], "data": vec![0.25f32; 784] }],
            "parameters": { "sequence_id": id, "sequence_start": start, "sequence_end": end },
        })
    };
    let two = "/v2/models/two/infer";
    for id in [1, 2] {
        assert_eq!(
            post_json(server.http, two, &digit_frame(id, true, false)).status,
            200
        );
    }
    let full = post_json(server.http, two, &digit_frame(3, true, false));
    assert_eq!(full.status, 429, "{}", full.error());
    assert!(
        full.error().contains("2 active sequences"),
        "{}",
        full.error()
    );
    let metrics = common::http(server.http, "GET", "/metrics", &[], b"");
    assert!(
        String::from_utf8_lossy(&metrics.body)
            .contains("kiln_stream_sequences_active{model=\"two\"} 2")
    );
    assert_eq!(
        post_json(server.http, two, &digit_frame(1, false, true)).status,
        200
    );
    assert_eq!(
        post_json(server.http, two, &digit_frame(3, true, false)).status,
        200
    );

    let config = common::http(server.http, "GET", "/v2/models/cam/config", &[], b"").json();
    assert_eq!(
        config["sequence_batching"]["max_sequence_idle_microseconds"],
        60_000_000
    );
    assert_eq!(config["output"][0]["dims"], json!([4]));
    assert_eq!(config["input"][0]["dims"], json!([1, 56, 56]));
}

/// A one-layer classifier graph on `[1, side, side]` inputs with seeded weights of `scale`:
/// a cheap cascade stage whose confidence varies from frame to frame.
fn linear_stage(path: &std::path::Path, side: usize, scale: f32, seed: u64) {
    let mut state = seed;
    let values: Vec<f32> = (0..side * side * 10)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect();
    let mut graph = Graph::new("stage", [1, side, side]);
    graph.push(
        "fc",
        Op::Linear {
            weight: Weight::new(vec![side * side, 10], values),
            bias: None,
        },
        vec![Graph::INPUT],
    );
    save_graph(&graph, path).unwrap();
}

#[test]
fn a_cascade_of_cheaper_stages_answers_first_and_matches_the_library() {
    let repo = tempdir("stream-cascade");
    let settings = "max_batch_size = 8\n[sequence_batching]\nframe_dims = [1, 56, 56]\n\
        regions = [[0, 0, 28, 28], [28, 0, 28, 28], [0, 28, 28, 28], [28, 28, 28, 28]]\n\
        cascade = [{ graph = \"coarse.kgraph\", threshold = 0.6 }, { graph = \"early.kgraph\", threshold = 0.6 }]\n";
    let graph = write_cnn_model(&repo, "cam", settings);
    let dir = graph.parent().unwrap().to_path_buf();
    linear_stage(&dir.join("coarse.kgraph"), 14, 0.6, 1);
    linear_stage(&dir.join("early.kgraph"), 28, 0.5, 2);
    let server = TestServer::start(&repo);

    let device = Device::flex();
    let session = |p: &std::path::Path| -> Box<dyn FrameClassifier + Send> {
        Box::new(InferenceSession::from_graph(load_graph(p).unwrap(), &device).unwrap())
    };
    let cascade = Cascade::new(
        vec![
            Stage {
                model: session(&dir.join("coarse.kgraph")),
                threshold: 0.6,
            },
            Stage {
                model: session(&dir.join("early.kgraph")),
                threshold: 0.6,
            },
        ],
        session(&graph),
    )
    .unwrap();
    let config = server.model("cam").config.clone().sequence.unwrap().stream;
    let mut local = StreamProcessor::new([1, 56, 56], &config, &device).unwrap();
    let v = video(12, 9);
    let mut exits = std::collections::BTreeSet::new();
    for (i, f) in v.frames.iter().enumerate() {
        let r = post_json(
            server.http,
            "/v2/models/cam/infer",
            &frame_body(f, json!(3), i == 0, false),
        );
        assert_eq!(r.status, 200, "{}", r.error());
        let answer = r.json();
        let (labels, _, fresh) = outputs(&answer);
        let exit: Vec<i64> = answer["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["name"] == "exit")
            .expect("a cascade reports which stage answered")["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        let expected = local.process(f, &cascade).unwrap();
        for (k, region) in expected.regions.iter().enumerate() {
            assert_eq!(
                labels[k], region.prediction.class as i64,
                "frame {i} region {k}"
            );
            assert_eq!(fresh[k], 1, "no gate: every region runs");
            let Route::Exit(stage) = region.prediction.route else {
                panic!("a cascade answers with exits")
            };
            assert_eq!(exit[k], stage as i64, "frame {i} region {k}");
            exits.insert(stage);
        }
    }
    assert_eq!(
        exits.into_iter().collect::<Vec<_>>(),
        vec![0, 1, 2],
        "the coarse stage, the early stage and the model each answered some regions"
    );
}

/// A 3 × 32 × 64 frame, black with an 8-pixel white square at `(x, y)`.
fn square_frame(x: usize, y: usize) -> Frame {
    let (h, w) = (32, 64);
    let mut px = vec![0f32; 3 * h * w];
    for c in 0..3 {
        for yy in y..y + 8 {
            for xx in x..x + 8 {
                px[(c * h + yy) * w + xx] = 1.0;
            }
        }
    }
    Frame::new([3, h, w], px).unwrap()
}

/// The named output's data of a response.
fn output(r: &Value, name: &str) -> Vec<i64> {
    r["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["name"] == name)
        .unwrap_or_else(|| panic!("no output {name} in {r}"))["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

#[test]
fn a_per_frame_model_serves_concurrent_sequences_with_gate_and_regions_matching_the_full_model() {
    use kiln::onnx::OnnxModel;
    use kiln::stream::{FrameModel, FrameResult, OnnxFrameModel, OutputKind};
    let repo = tempdir("per-frame");
    let dir = common::write_model(
        &repo,
        "seg",
        "backend = \"onnx\"\nfile = \"model.onnx\"\nmax_batch_size = 8\ninstances = 1\n\
         [dynamic_batching]\nmax_queue_delay_microseconds = 2000\n\
         [sequence_batching]\nframe_dims = [3, 32, 64]\noutput = \"mask\"\n\
         tiles = { tile = 2, threshold = 0.05, margin = 8, align = 8, max_area = 0.9 }\n\
         frame_gate = { threshold = 0.05, max_reuse_age = 30 }\n",
    );
    let onnx = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tiny_mask.onnx");
    std::fs::copy(onnx, dir.join("model.onnx")).unwrap();
    let server = TestServer::start(&repo);
    let meta = common::http(server.http, "GET", "/v2/models/seg", &[], &[]);
    let outputs: Vec<String> = meta.json()["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(outputs, ["mask", "path", "pixels_run"], "{}", meta.json());

    let local = OnnxFrameModel::new(
        OnnxModel::load(std::path::Path::new(onnx), &Device::flex()).unwrap(),
        Some(OutputKind::Mask),
    )
    .unwrap();
    // Three cameras, each with its own square moving right (one still frame in between).
    let moves = |s: usize| -> Vec<(usize, usize)> {
        let y = 4 + 8 * s;
        vec![(4, y), (4, y), (8, y), (12, y), (12, y), (16, y), (40, y)]
    };
    let served: Vec<Vec<Value>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|s| {
                let server = &server;
                scope.spawn(move || {
                    let steps = moves(s);
                    steps
                        .iter()
                        .enumerate()
                        .map(|(i, &(x, y))| {
                            let f = square_frame(x, y);
                            let body = json!({
                                "inputs": [{ "name": "frames", "datatype": "FP32", "shape": [1, 3, 32, 64], "data": f.pixels() }],
                                "parameters": { "sequence_id": format!("cam-{s}"), "sequence_start": i == 0, "sequence_end": i + 1 == steps.len() },
                            });
                            let r = post_json(server.http, "/v2/models/seg/infer", &body);
                            assert_eq!(r.status, 200, "{}", r.error());
                            r.json()
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (s, responses) in served.iter().enumerate() {
        let mut paths = Vec::new();
        for (r, &(x, y)) in responses.iter().zip(&moves(s)) {
            let f = square_frame(x, y);
            let FrameResult::Mask { labels, .. } = local.run(&[&f], false).unwrap().remove(0)
            else {
                panic!("not a mask")
            };
            let full: Vec<i64> = labels.iter().map(|&l| i64::from(l)).collect();
            assert!(full.contains(&1) && full.contains(&0));
            assert_eq!(output(r, "mask"), full, "camera {s}, square at {x},{y}");
            let (path, pixels) = (output(r, "path")[0], output(r, "pixels_run")[0]);
            if path == 1 {
                assert!(pixels > 0 && pixels < 32 * 64, "{pixels}");
            }
            paths.push(path);
        }
        // Full first, the still frames reused, the moves run as crops.
        assert_eq!(paths, [2, 0, 1, 1, 0, 1, 1], "camera {s}");
    }
}
