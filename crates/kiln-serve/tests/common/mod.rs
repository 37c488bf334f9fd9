//! Shared test helpers: a model repository in a temp dir, an in-process server, and a
//! minimal blocking HTTP/1.1 client (so the tests need no HTTP client crate).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use kiln::infer::{InferenceSession, load_graph, lower, save_graph};
use kiln::zoo::ModelKind;
use kiln_serve::{Repository, RepositoryOptions, Server, ServerOptions, Stages};

#[path = "../../../kiln/tests/common/test_dir.rs"]
mod test_dir;
pub use test_dir::TestDir;

/// A fresh [`TestDir`] named after the test.
pub fn tempdir(name: &str) -> TestDir {
    TestDir::new(&format!("serve-{name}"))
}

/// Writes `repo/name/config.toml`.
pub fn write_model(repo: &Path, name: &str, config: &str) -> PathBuf {
    let dir = repo.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), config).unwrap();
    dir
}

/// Writes model `name` serving `tests/data/fails_above_batch_2.onnx` (written by
/// `tools/make_failing_onnx.py`: y = x + x[0:2], whose forward fails for a batch of 3 or
/// more) with `max_batch_size = 8`.
pub fn write_failing_model(repo: &Path, name: &str) {
    let dir = write_model(
        repo,
        name,
        "backend = \"onnx\"\nfile = \"model.onnx\"\nmax_batch_size = 8\n",
    );
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/fails_above_batch_2.onnx"
        ),
        dir.join("model.onnx"),
    )
    .unwrap();
}

/// Writes model `name` serving a freshly initialized W3 CNN graph (`model.kgraph`), with
/// `settings` appended to its config; returns the graph's path.
pub fn write_cnn_model(repo: &Path, name: &str, settings: &str) -> PathBuf {
    let config = format!("backend = \"graph\"\ngraph = \"model.kgraph\"\n{settings}");
    let graph = write_model(repo, name, &config).join("model.kgraph");
    write_cnn_graph(&graph);
    graph
}

/// Saves a freshly initialized W3 CNN's f32 inference graph as `path`.
pub fn write_cnn_graph(path: &Path) {
    let device = Device::flex();
    let model = ModelKind::Cnn.init(&device);
    let graph = lower(&model, "cnn", [1, 28, 28]).unwrap();
    save_graph(&graph, path).unwrap();
}

/// Logits of `images` (`[batch, 1, 28, 28]`) from the graph at `path`, run alone in-process:
/// the single-request reference the server's batched answers are compared with.
pub fn reference_logits(path: &Path, images: &[f32], batch: usize) -> Vec<f32> {
    let device = Device::flex();
    let session = InferenceSession::from_graph(load_graph(path).unwrap(), &device).unwrap();
    let x: Tensor<4> = Tensor::from_data(
        TensorData::new(images.to_vec(), [batch, 1, 28, 28]),
        &device,
    );
    session
        .forward(x)
        .unwrap()
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap()
}

/// A server running on its own tokio runtime; stopped (gracefully) by [`TestServer::stop`].
pub struct TestServer {
    /// HTTP address.
    pub http: SocketAddr,
    /// gRPC address.
    pub grpc: SocketAddr,
    /// The repository it serves (for in-process checks of counters).
    pub repository: Arc<Repository>,
    /// The runtime (also usable for gRPC clients).
    pub runtime: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<kiln_serve::Result<()>>>,
}

impl TestServer {
    /// Loads `repo` and serves it on free loopback ports, with `max_body_bytes`.
    pub fn start_with(repo: &Path, max_body_bytes: usize) -> Self {
        Self::start_staged(repo, max_body_bytes, Stages::staged(1))
    }

    /// [`TestServer::start_with`] with the given stage placement.
    pub fn start_staged(repo: &Path, max_body_bytes: usize, stages: Stages) -> Self {
        let options = RepositoryOptions {
            stages,
            ..RepositoryOptions::default()
        };
        Self::start_options(repo, max_body_bytes, options)
    }

    /// A server over `repo` opened with `options` (model control mode, start-up models).
    pub fn start_options(repo: &Path, max_body_bytes: usize, options: RepositoryOptions) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let repository = Arc::new(Repository::open(repo, options).unwrap());
        let options = ServerOptions {
            http: "127.0.0.1:0".parse().unwrap(),
            grpc: Some("127.0.0.1:0".parse().unwrap()),
            max_body_bytes,
        };
        let server = runtime
            .block_on(Server::bind(Arc::clone(&repository), &options))
            .unwrap();
        let http = server.http_addr().unwrap();
        let grpc = server.grpc_addr().unwrap().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let done = runtime.spawn(server.run(async {
            let _ = stopped.await;
        }));
        TestServer {
            http,
            grpc,
            repository,
            runtime,
            stop: Some(stop),
            done: Some(done),
        }
    }

    /// [`TestServer::start_with`] with the default body limit.
    pub fn start(repo: &Path) -> Self {
        Self::start_with(repo, kiln_serve::MAX_BODY_BYTES)
    }

    /// Begins a graceful shutdown and waits for it to finish.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            self.runtime.block_on(done).unwrap().unwrap();
        }
    }

    /// A counter of model `name`'s metrics, read in-process.
    pub fn model(&self, name: &str) -> Arc<kiln_serve::pipeline::ModelRuntime> {
        self.repository.runtime(name).unwrap()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A response: status, headers (lower-cased names), body.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Header (name, value) pairs.
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `error` message of an error response.
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A server may answer (e.g. an oversized body) before reading everything: ignore EPIPE.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

/// Parses a raw HTTP/1.1 response (chunked bodies joined).
pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP header in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[eol + 2 + size + 2..];
    }
}

/// POSTs a JSON body.
pub fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// Random images in [0, 1) from a small LCG (reproducible per seed).
pub fn images(seed: u64, batch: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..batch * 784)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

/// A KServe v2 JSON body with one FP32 input.
pub fn infer_body(name: &str, shape: &[usize], data: &[f32]) -> serde_json::Value {
    serde_json::json!({ "inputs": [{ "name": name, "datatype": "FP32", "shape": shape, "data": data }] })
}

/// POSTs every body at once, one thread each; (status, error message or "") per body.
pub fn concurrent_posts(
    addr: std::net::SocketAddr,
    path: &str,
    bodies: impl Iterator<Item = serde_json::Value>,
) -> Vec<(u16, String)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .map(|body| {
                s.spawn(move || {
                    let r = post_json(addr, path, &body);
                    let message = if r.status == 200 {
                        String::new()
                    } else {
                        r.error()
                    };
                    (r.status, message)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A gRPC `ModelInferRequest` for `model` with one FP32 input `name` of `shape` whose values
/// are the little-endian bytes `raw`.
pub fn grpc_request(
    model: &str,
    name: &str,
    shape: Vec<i64>,
    raw: Vec<u8>,
) -> kiln_serve::grpc::pb::ModelInferRequest {
    use kiln_serve::grpc::pb;
    pb::ModelInferRequest {
        model_name: model.into(),
        id: "req".into(),
        inputs: vec![pb::model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: "FP32".into(),
            shape,
            ..Default::default()
        }],
        raw_input_contents: vec![raw],
        ..Default::default()
    }
}

/// Model `name`'s configuration over gRPC (`ModelConfig`, Triton's protobuf).
pub async fn grpc_model_config(
    client: &mut kiln_serve::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient<
        tonic::transport::Channel,
    >,
    name: &str,
) -> kiln_serve::grpc::pb::ModelConfig {
    client
        .model_config(kiln_serve::grpc::pb::ModelConfigRequest {
            name: name.into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap()
}

/// Little-endian bytes of f32 values (gRPC `raw_input_contents`).
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
