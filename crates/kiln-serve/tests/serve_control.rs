//! Model control (the repository extension): numbered versions and their policy, a reload
//! under load that drops nothing, a broken version that leaves the serving one in place,
//! unload, poll mode, warm-up before ready, the modes that refuse control, and start-up
//! warnings.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor, TensorData};
use common::{
    HttpResponse, TestServer, f32_bytes, grpc_request, http, images, infer_body, post_json,
    tempdir, write_cnn_graph, write_model,
};
use kiln::infer::{InferenceSession, load_graph};
use kiln_serve::grpc::pb;
use kiln_serve::{ModelControlMode, Repository, RepositoryOptions, Stages};
use pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use serde_json::json;

/// The model-level config of a versioned W3 graph model (each version directory holds its
/// own `model.kgraph`).
const W3_VERSIONED: &str = "backend = \"graph\"\ngraph = \"model.kgraph\"\nmax_batch_size = 8\n\
     [dynamic_batching]\nmax_queue_delay_microseconds = 1000\n[warmup]\nbatch_size = 4\n";

fn options(mode: ModelControlMode, startup: &[&str]) -> RepositoryOptions {
    RepositoryOptions {
        stages: Stages::staged(1),
        mode,
        startup_models: startup.iter().map(|s| s.to_string()).collect(),
        drain_timeout: Duration::from_secs(30),
        ..RepositoryOptions::default()
    }
}

/// Writes a fresh W3 graph as version `v` of model `name`; returns its path.
fn write_version(repo: &Path, name: &str, v: u64) -> PathBuf {
    let dir = repo.join(name).join(v.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let graph = dir.join("model.kgraph");
    write_cnn_graph(&graph);
    graph
}

/// Single-request reference logits from a graph file, with the session built once.
struct Reference(InferenceSession);

impl Reference {
    fn new(graph: &Path) -> Self {
        let session =
            InferenceSession::from_graph(load_graph(graph).unwrap(), &Device::flex()).unwrap();
        Reference(session)
    }

    fn logits(&self, images: &[f32]) -> Vec<f32> {
        let x: Tensor<4> = Tensor::from_data(
            TensorData::new(images.to_vec(), [1, 1, 28, 28]),
            &Device::flex(),
        );
        self.0
            .forward(x)
            .unwrap()
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap()
    }
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

fn load(addr: std::net::SocketAddr, model: &str) -> HttpResponse {
    post_json(
        addr,
        &format!("/v2/repository/models/{model}/load"),
        &json!({}),
    )
}

fn unload(addr: std::net::SocketAddr, model: &str) -> HttpResponse {
    post_json(
        addr,
        &format!("/v2/repository/models/{model}/unload"),
        &json!({ "parameters": { "unload_dependents": false } }),
    )
}

/// The repository index as (name, version, state, reason) rows.
fn index(addr: std::net::SocketAddr) -> Vec<(String, String, String, String)> {
    let r = http(addr, "POST", "/v2/repository/index", &[], b"");
    assert_eq!(r.status, 200, "{}", r.error());
    r.json()
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            (s("name"), s("version"), s("state"), s("reason"))
        })
        .collect()
}

/// Sets its flag when dropped (also while unwinding from a panic).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// One answered request: which version answered, its input's seed, its logits, or the error.
type Answer = (u64, std::result::Result<(String, Vec<f32>), String>);

/// Clients on HTTP and gRPC sending single images to `model` until `stop`; every answer.
fn hammer(server: &TestServer, model: &str, clients: usize, stop: &AtomicBool) -> Vec<Answer> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let (http_addr, grpc_addr) = (server.http, server.grpc);
                let model = model.to_string();
                s.spawn(move || {
                    let mut out = Vec::new();
                    let grpc_runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    let mut grpc = (c % 2 == 1).then(|| {
                        grpc_runtime
                            .block_on(GrpcInferenceServiceClient::connect(format!(
                                "http://{grpc_addr}"
                            )))
                            .unwrap()
                    });
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let seed = (c as u64) << 32 | i;
                        i += 1;
                        let x = images(seed, 1);
                        let answer = match &mut grpc {
                            None => {
                                let r = post_json(
                                    http_addr,
                                    &format!("/v2/models/{model}/infer"),
                                    &infer_body("images", &[1, 1, 28, 28], &x),
                                );
                                if r.status == 200 {
                                    let v = r.json();
                                    let logits = v["outputs"][0]["data"]
                                        .as_array()
                                        .unwrap()
                                        .iter()
                                        .map(|x| x.as_f64().unwrap() as f32)
                                        .collect();
                                    Ok((v["model_version"].as_str().unwrap().to_string(), logits))
                                } else {
                                    Err(format!("HTTP {}: {}", r.status, r.error()))
                                }
                            }
                            Some(client) => {
                                let request = grpc_request(
                                    &model,
                                    "images",
                                    vec![1, 1, 28, 28],
                                    f32_bytes(&x),
                                );
                                match grpc_runtime.block_on(client.model_infer(request)) {
                                    Ok(r) => {
                                        let r = r.into_inner();
                                        let logits = r.raw_output_contents[0]
                                            .chunks_exact(4)
                                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                                            .collect();
                                        Ok((r.model_version, logits))
                                    }
                                    Err(status) => Err(format!("gRPC {status}")),
                                }
                            }
                        };
                        out.push((seed, answer));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// A JSON inference request whose body arrives in two halves `pause` apart, as a large upload
/// on a slow link does: its handler holds the model version it looked up while it waits.
fn slow_infer(addr: std::net::SocketAddr, model: &str, x: &[f32], pause: Duration) -> HttpResponse {
    use std::io::{Read, Write};
    let body = infer_body("images", &[1, 1, 28, 28], x).to_string();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let (first, rest) = body.as_bytes().split_at(body.len() / 2);
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(first).unwrap();
    std::thread::sleep(pause);
    stream.write_all(rest).unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    common::parse_response(&raw)
}

/// Waits until `done` holds, up to 20 s.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_new_version_loads_under_load_a_broken_one_is_refused_and_nothing_is_dropped() {
    let repo = tempdir("control-reload");
    write_model(&repo, "w3", W3_VERSIONED);
    let v1 = write_version(&repo, "w3", 1);
    let mut server = TestServer::start_options(
        &repo,
        kiln_serve::MAX_BODY_BYTES,
        options(ModelControlMode::Explicit, &["w3"]),
    );
    let old = Arc::downgrade(&server.model("w3"));
    assert_eq!(server.model("w3").version, 1);

    let stop = AtomicBool::new(false);
    let (answers, steps) = std::thread::scope(|s| {
        let clients = s.spawn(|| hammer(&server, "w3", 4, &stop));
        // The clients stop however this thread ends, so a failed assertion fails the test
        // instead of leaving the scope waiting for them forever.
        let _stop_clients = StopOnDrop(&stop);
        let addr = server.http;
        let mut steps = Vec::new();
        std::thread::sleep(Duration::from_millis(300));
        // Uploads in progress across the switch: their handlers already hold version 1.
        let uploads: Vec<_> = (0..3)
            .map(|k| {
                s.spawn(move || {
                    slow_infer(addr, "w3", &images(900 + k, 1), Duration::from_millis(800))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // Version 2 appears on disk and is loaded: it is built and warmed beside version 1,
        // then takes the new requests while version 1 finishes its own.
        let v2 = write_version(&repo, "w3", 2);
        let r = load(addr, "w3");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        steps.push(index(addr));
        for (k, upload) in uploads.into_iter().enumerate() {
            let r = upload.join().unwrap();
            assert_eq!(r.status, 200, "upload {k} across the switch: {}", r.error());
            assert_eq!(
                r.json()["model_version"],
                "1",
                "upload {k} was looked up on version 1"
            );
        }
        std::thread::sleep(Duration::from_millis(300));
        // A broken version 3 (a truncated graph file) is offered: the load fails with the
        // reason, version 2 keeps serving.
        let v3 = repo.join("w3").join("3");
        std::fs::create_dir_all(&v3).unwrap();
        let bytes = std::fs::read(&v2).unwrap();
        std::fs::write(v3.join("model.kgraph"), &bytes[..bytes.len() / 3]).unwrap();
        let r = load(addr, "w3");
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert!(r.error().contains("version 3"), "{}", r.error());
        steps.push(index(addr));
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        (clients.join().unwrap(), steps)
    });

    // After the first load: only version 2 serves; after the broken offer: 2 still serves and
    // 3 is listed with its reason.
    let rows = |step: &Vec<(String, String, String, String)>| {
        step.iter()
            .map(|(_, v, state, _)| format!("{v}:{state}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(rows(&steps[0]), vec!["2:READY"]);
    assert_eq!(
        rows(&steps[1]),
        vec!["2:READY", "3:UNAVAILABLE"],
        "{:?}",
        steps[1]
    );
    assert!(!steps[1][1].3.is_empty(), "version 3 lists no reason");

    // Zero failed requests, and every answer is exactly what the version that says it
    // answered computes.
    let references = [
        Reference::new(&v1),
        Reference::new(&repo.join("w3/2/model.kgraph")),
    ];
    let probe = images(7, 1);
    assert!(
        max_rel_diff(&references[0].logits(&probe), &references[1].logits(&probe)) > 1e-3,
        "versions 1 and 2 compute the same: the test could not tell them apart"
    );
    let mut per_version = [0usize; 2];
    for (seed, answer) in &answers {
        let (version, logits) = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("failed request: {e}"));
        let v: usize = version.parse().unwrap();
        assert!(v == 1 || v == 2, "answered by version {version}");
        let expected = references[v - 1].logits(&images(*seed, 1));
        let diff = max_rel_diff(logits, &expected);
        assert!(diff <= 1e-5, "version {v}: logits differ by {diff}");
        per_version[v - 1] += 1;
    }
    assert!(
        per_version[0] > 0 && per_version[1] > 0,
        "both versions should have answered: {per_version:?}"
    );
    eprintln!(
        "{} requests, per version {per_version:?}, 0 failed",
        answers.len()
    );

    // Version 1 drained and was freed: nothing holds it any more.
    wait_for("version 1 to drain", || server.repository.draining() == 0);
    assert!(
        old.upgrade().is_none(),
        "version 1 is still alive after its drain"
    );

    // Unload: the model stops serving, its index row says why, and version 2 is freed too.
    let v2_runtime = Arc::downgrade(&server.model("w3"));
    let r = unload(server.http, "w3");
    assert_eq!(r.status, 200, "{}", r.error());
    let r = post_json(
        server.http,
        "/v2/models/w3/infer",
        &infer_body("images", &[1, 1, 28, 28], &probe),
    );
    assert_eq!(r.status, 400);
    assert!(r.error().contains("unloaded"), "{}", r.error());
    assert_eq!(
        index(server.http),
        vec![(
            "w3".into(),
            String::new(),
            "UNAVAILABLE".into(),
            "unloaded".into()
        )]
    );
    wait_for("version 2 to drain", || server.repository.draining() == 0);
    assert!(
        v2_runtime.upgrade().is_none(),
        "version 2 is alive after unload"
    );

    // Loading it again brings back the latest good version... which is 3's broken files
    // under the latest-1 policy: the load fails and says so.
    let r = load(server.http, "w3");
    assert_eq!(r.status, 400);
    std::fs::remove_dir_all(repo.join("w3/3")).unwrap();
    let r = load(server.http, "w3");
    assert_eq!(r.status, 200, "{}", r.error());
    assert_eq!(server.model("w3").version, 2);
    server.stop();
}

#[test]
fn versions_are_routed_reported_and_counted_apart() {
    let repo = tempdir("control-versions");
    write_model(
        &repo,
        "m",
        &W3_VERSIONED.replace(
            "max_batch_size = 8",
            "max_batch_size = 8\nversion_policy = \"all\"",
        ),
    );
    let g1 = write_version(&repo, "m", 1);
    let g2 = write_version(&repo, "m", 2);
    let server = TestServer::start(&repo);
    let addr = server.http;
    let x = images(3, 1);
    for (path, version, graph) in [
        ("/v2/models/m/versions/1/infer", "1", &g1),
        ("/v2/models/m/versions/2/infer", "2", &g2),
        ("/v2/models/m/infer", "2", &g2),
    ] {
        let r = post_json(addr, path, &infer_body("images", &[1, 1, 28, 28], &x));
        assert_eq!(r.status, 200, "{path}: {}", r.error());
        let v = r.json();
        assert_eq!(v["model_version"], version, "{path}");
        let logits: Vec<f32> = v["outputs"][0]["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert!(max_rel_diff(&logits, &Reference::new(graph).logits(&x)) <= 1e-5);
    }
    let meta = http(addr, "GET", "/v2/models/m", &[], b"").json();
    assert_eq!(meta["versions"], json!(["1", "2"]));
    // The configuration reports the policy and the warm-up in Triton's JSON forms.
    let config = http(addr, "GET", "/v2/models/m/config", &[], b"").json();
    assert_eq!(config["version_policy"], json!({ "all": {} }));
    assert_eq!(config["model_warmup"][0]["batch_size"], 4);
    assert_eq!(
        config["model_warmup"][0]["inputs"]["images"]["zero_data"],
        true
    );
    assert_eq!(
        http(addr, "GET", "/v2/models/m/versions/1/ready", &[], b"").status,
        200
    );
    let missing = http(addr, "GET", "/v2/models/m/versions/3/ready", &[], b"");
    assert_eq!(missing.status, 404);
    assert!(
        missing.error().contains("versions: 1, 2"),
        "{}",
        missing.error()
    );
    // Two versions serving side by side are two series, told apart by a version label.
    let metrics = String::from_utf8(http(addr, "GET", "/metrics", &[], b"").body).unwrap();
    assert!(metrics.contains("kiln_request_success_total{model=\"m\",version=\"1\"} 1"));
    assert!(metrics.contains("kiln_request_success_total{model=\"m\",version=\"2\"} 2"));
    // gRPC: readiness per version, metadata, and inference on a named version.
    server.runtime.block_on(async {
        let mut c = GrpcInferenceServiceClient::connect(format!("http://{}", server.grpc))
            .await
            .unwrap();
        let ready = |version: &str| pb::ModelReadyRequest {
            name: "m".into(),
            version: version.into(),
        };
        assert!(c.model_ready(ready("1")).await.unwrap().into_inner().ready);
        assert!(!c.model_ready(ready("9")).await.unwrap().into_inner().ready);
        let mut request = grpc_request("m", "images", vec![1, 1, 28, 28], f32_bytes(&x));
        request.model_version = "1".into();
        let r = c.model_infer(request).await.unwrap().into_inner();
        assert_eq!(r.model_version, "1");
        let index = c
            .repository_index(pb::RepositoryIndexRequest {
                repository_name: String::new(),
                ready: true,
            })
            .await
            .unwrap()
            .into_inner();
        let versions: Vec<&str> = index.models.iter().map(|m| m.version.as_str()).collect();
        assert_eq!(versions, vec!["1", "2"]);
    });
}

#[test]
fn grpc_loads_and_unloads_with_tritons_messages() {
    let repo = tempdir("control-grpc");
    write_model(
        &repo,
        "id",
        "backend = \"identity\"\ndims = [4]\n[warmup]\ncount = 2\ndata = \"random\"\n",
    );
    let server = TestServer::start_options(
        &repo,
        kiln_serve::MAX_BODY_BYTES,
        options(ModelControlMode::Explicit, &[]),
    );
    // Nothing loaded yet: listed, not ready, and the server itself is ready (explicit mode).
    assert_eq!(
        index(server.http),
        vec![(
            "id".into(),
            String::new(),
            "UNAVAILABLE".into(),
            "not loaded (explicit model control: POST /v2/repository/models/M/load)".into()
        )]
    );
    assert_eq!(
        http(server.http, "GET", "/v2/health/ready", &[], b"").status,
        200
    );
    server.runtime.block_on(async {
        let mut c = GrpcInferenceServiceClient::connect(format!("http://{}", server.grpc))
            .await
            .unwrap();
        let load = |name: &str, parameters| pb::RepositoryModelLoadRequest {
            repository_name: String::new(),
            model_name: name.into(),
            parameters,
        };
        c.repository_model_load(load("id", Default::default()))
            .await
            .unwrap();
        let ready = pb::ModelReadyRequest {
            name: "id".into(),
            version: String::new(),
        };
        assert!(
            c.model_ready(ready.clone())
                .await
                .unwrap()
                .into_inner()
                .ready
        );
        // Triton's configuration override is refused with the fix.
        let config = pb::ModelRepositoryParameter {
            parameter_choice: Some(
                pb::model_repository_parameter::ParameterChoice::StringParam("{}".into()),
            ),
        };
        let err = c
            .repository_model_load(load("id", [("config".to_string(), config)].into()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("config.toml"), "{}", err.message());
        // A name that would leave the repository is refused before any file is touched.
        let err = c
            .repository_model_load(load("../id", Default::default()))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::InvalidArgument,
            "{}",
            err.message()
        );
        assert_eq!(
            c.repository_model_load(load("nope", Default::default()))
                .await
                .unwrap_err()
                .code(),
            tonic::Code::NotFound
        );
        c.repository_model_unload(pb::RepositoryModelUnloadRequest {
            repository_name: String::new(),
            model_name: "id".into(),
            parameters: Default::default(),
        })
        .await
        .unwrap();
        assert!(!c.model_ready(ready).await.unwrap().into_inner().ready);
    });
    let traversal = load(server.http, "..%2Fcontrol-grpc");
    assert_eq!(traversal.status, 400, "{}", traversal.error());
}

#[test]
fn a_warm_up_that_fails_keeps_the_model_from_ready() {
    let repo = tempdir("control-warmup");
    // y = x + x[0:2]: runs for a batch of 1 or 2, fails above (tests/data/fails_above_batch_2).
    for (name, batch) in [("ok", 2), ("fails", 3)] {
        common::write_failing_model(&repo, name);
        let config = repo.join(name).join("config.toml");
        let mut text = std::fs::read_to_string(&config).unwrap();
        text.push_str(&format!("[warmup]\nbatch_size = {batch}\n"));
        std::fs::write(&config, text).unwrap();
    }
    let repository = Repository::open(&repo, options(ModelControlMode::None, &[])).unwrap();
    assert!(repository.runtime("ok").is_ok());
    let err = repository.runtime("fails").unwrap_err().to_string();
    assert!(
        err.contains("warm-up failed on instance 0 (batch 3)"),
        "{err}"
    );
    assert_eq!(repository.failures().len(), 1);
    repository.shutdown();
}

#[test]
fn poll_mode_follows_the_directory() {
    let repo = tempdir("control-poll");
    write_model(&repo, "a", "backend = \"identity\"\ndims = [4]\n");
    let repository =
        Arc::new(Repository::open(&repo, options(ModelControlMode::Poll, &[])).unwrap());
    repository.start_polling(Duration::from_millis(50)).unwrap();
    let dims = |name: &str| {
        repository
            .runtime(name)
            .map(|rt| rt.spec.inputs[0].dims.clone())
    };
    assert_eq!(dims("a").unwrap(), vec![4]);
    // A new model appears.
    write_model(&repo, "b", "backend = \"identity\"\ndims = [2]\n");
    wait_for("model b to load", || dims("b").is_ok());
    // A changed config reloads the model (a different size, so the file's length differs
    // even where the clock is coarse).
    let a = Arc::downgrade(&repository.runtime("a").unwrap());
    write_model(&repo, "a", "backend = \"identity\"\ndims = [16]\n");
    wait_for("model a to reload", || {
        dims("a").is_ok_and(|d| d == vec![16])
    });
    wait_for("the old a to drain", || a.upgrade().is_none());
    // A broken config keeps the previous load serving and says why.
    write_model(
        &repo,
        "a",
        "backend = \"identity\"\ndims = [16]\nbogus_key = 1\n",
    );
    wait_for("the broken config to be seen", || {
        repository
            .index()
            .iter()
            .any(|r| r.name == "a" && r.reason.contains("bogus_key"))
    });
    assert_eq!(dims("a").unwrap(), vec![16]);
    // A removed directory unloads the model.
    std::fs::remove_dir_all(repo.join("b")).unwrap();
    wait_for("model b to unload", || !repository.contains("b"));
    // Clients cannot load or unload in poll mode: the directory is the control.
    let err = repository.request_load("a").unwrap_err().to_string();
    assert!(err.contains("not allowed in poll mode"), "{err}");
    repository.shutdown();
}

#[test]
fn without_model_control_load_and_unload_are_refused_with_the_fix() {
    let repo = tempdir("control-none");
    write_model(&repo, "id", "backend = \"identity\"\ndims = [4]\n");
    let server = TestServer::start(&repo);
    for r in [load(server.http, "id"), unload(server.http, "id")] {
        assert_eq!(r.status, 400);
        assert!(
            r.error().contains("--model-control-mode explicit"),
            "{}",
            r.error()
        );
    }
    assert!(server.repository.runtime("id").is_ok());
    // Bad bodies name the problem.
    let r = http(
        server.http,
        "POST",
        "/v2/repository/index",
        &[],
        b"{\"ready\": 1}",
    );
    assert_eq!(r.status, 400);
    assert!(r.error().contains("must be a boolean"), "{}", r.error());
    let r = http(
        server.http,
        "POST",
        "/v2/repository/index",
        &[],
        b"{\"ready\": true}",
    );
    assert_eq!(r.json().as_array().map(Vec::len), Some(1));
}

#[test]
fn start_up_warns_about_an_empty_repository_and_a_models_own_directory() {
    let empty = tempdir("control-empty");
    let repository = Repository::open(&empty, RepositoryOptions::default()).unwrap();
    assert!(
        repository
            .warnings()
            .iter()
            .any(|w| w.contains("holds no model directories") && w.contains("<model>/config.toml")),
        "{:?}",
        repository.warnings()
    );
    let repo = tempdir("control-own-dir");
    let model_dir = write_model(&repo, "id", "backend = \"identity\"\ndims = [4]\n");
    let repository = Repository::open(&model_dir, RepositoryOptions::default()).unwrap();
    let warning = repository.warnings().join("\n");
    assert!(
        warning.contains("looks like one model's own directory")
            && warning.contains(&format!("--models {}", repo.display())),
        "{warning}"
    );
    // Explicit mode with a start-up model that is not there is an error naming it.
    let err = Repository::open(&repo, options(ModelControlMode::Explicit, &["nope"]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--load-model nope") && err.contains("models: id"),
        "{err}"
    );
}
