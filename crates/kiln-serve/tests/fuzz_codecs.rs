//! Mutation fuzzing (`kiln::fuzz`) of the wire decoders, alone (no server): the HTTP JSON
//! body, the HTTP binary tensor extension (JSON header + raw bytes), and the gRPC
//! `ModelInferRequest` from its protobuf bytes; the model control requests (HTTP bodies and
//! gRPC `RepositoryModelLoad`); and a model's `config.toml`, which arrives from whoever can
//! write into the repository — with poll mode, while the server runs. Every mutated input is
//! either accepted or refused with a clear error; never a panic.
//! Kept crashers: `tests/fuzz_regressions/`, replayed first.

use std::path::Path;

use kiln::fuzz::{HeapLimit, Summary, Target, cases, run};
use kiln_serve::codec::{grpc, http};
use kiln_serve::proto::pb;
use kiln_serve::signature::{ModelSpec, Postprocess};
use kiln_serve::tensor::{DataType, TensorSpec};
use prost::Message;

// Each thread's heap is counted so that every target's stated `HeapLimit` is checked.
#[global_allocator]
static ALLOC: kiln::observe::heap::CountingAlloc<std::alloc::System, true> =
    kiln::observe::heap::CountingAlloc::per_thread(std::alloc::System);

// The stated heap limits (docs/reliability.md) for one request, on the decoding thread: the
// decoded tensors and the parsed JSON tree are proportional to the body; a shape or size the
// request merely claims must not allocate (the batch limit is 8 here, as `decode` is told).
const HTTP_JSON: HeapLimit = HeapLimit::new(1, 32);
const HTTP_BINARY: HeapLimit = HeapLimit::new(1, 8);
const GRPC: HeapLimit = HeapLimit::new(1, 8);
// A config.toml: the TOML tree and the validated config, a few copies of the text (as the
// kiln.toml target states); the control bodies: a JSON tree or a protobuf map of parameters.
const SERVE_CONFIG: HeapLimit = HeapLimit::new(1, 64);
const CONTROL_HTTP: HeapLimit = HeapLimit::new(1, 32);
const CONTROL_GRPC: HeapLimit = HeapLimit::new(1, 8);

/// A model with two inputs (FP32 `[2]`, INT64 `[3]`), as an exported ONNX model has.
fn spec() -> ModelSpec {
    let tensor = |name: &str, datatype, dims: Vec<usize>| TensorSpec {
        name: name.into(),
        datatype,
        dims,
    };
    ModelSpec {
        platform: "fuzz".into(),
        inputs: vec![
            tensor("x", DataType::Fp32, vec![2]),
            tensor("ids", DataType::Int64, vec![3]),
        ],
        outputs: vec![tensor("y", DataType::Fp32, vec![2])],
        postprocess: Postprocess::None,
    }
}

/// Reports a fuzz run and fails it when no mutation of the seed got through: the seed
/// itself was not valid, so nothing deep was exercised. `what` says what went through.
fn seed_was_valid(summary: &Summary, seed_len: usize, what: &str) {
    eprintln!("seed {seed_len} bytes: {summary:?}");
    assert!(
        summary.accepted > 0,
        "no mutated {what}: is the seed valid?"
    );
}

fn target<'a>(name: &'a str, seed: &'a [u8], heap: HeapLimit) -> Target<'a> {
    Target {
        name,
        seed,
        heap,
        sealed: false,
        cases: cases() * 2,
        regressions: Some(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_regressions"
        ))),
    }
}

#[test]
fn http_json_bodies() {
    let spec = spec();
    let seed = br#"{"id":"r1","parameters":{"timeout":1000,"binary_data_output":false},
        "inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[1.0,2.5,-3,4e3]},
                  {"name":"ids","datatype":"INT64","shape":[2,3],"data":[[1,2,3],[4,5,6]]}],
        "outputs":[{"name":"y","parameters":{"binary_data":true}}]}"#;
    let summary = run(&target("http-json", seed, HTTP_JSON), |bytes| {
        http::decode(bytes, None, &spec, 8).map(drop)
    });
    seed_was_valid(&summary, seed.len(), "body decoded");
}

#[test]
fn http_binary_extension_bodies() {
    let spec = spec();
    let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}},{"name":"ids","datatype":"INT64","shape":[1,3],"parameters":{"binary_data_size":24}}]}"#;
    let mut seed = header.to_vec();
    seed.extend(1.5f32.to_le_bytes());
    seed.extend((-2.0f32).to_le_bytes());
    for id in [7i64, 8, 9] {
        seed.extend(id.to_le_bytes());
    }
    let len = header.len();
    // Few edits leave both the JSON header and its byte counts intact (about 1 in 70), and
    // the header length is fuzzed too: four times the cases, so valid requests are reached.
    let mut binary = target("http-binary", &seed, HTTP_BINARY);
    binary.cases *= 4;
    let summary = run(&binary, |bytes| {
        // The header length comes from an HTTP header: fuzz it too, around the true one.
        let header_len = match bytes.len() % 4 {
            0 => None,
            1 => Some(len + bytes.len() % 7),
            _ => Some(len.min(bytes.len())),
        };
        http::decode(bytes, header_len, &spec, 8).map(drop)
    });
    seed_was_valid(&summary, seed.len(), "body decoded");
}

#[test]
fn grpc_requests() {
    let spec = spec();
    let input =
        |name: &str, datatype: &str, shape: Vec<i64>| pb::model_infer_request::InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            ..Default::default()
        };
    let raw_x: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let raw_ids: Vec<u8> = (0..6i64).flat_map(|v| v.to_le_bytes()).collect();
    let request = pb::ModelInferRequest {
        model_name: "fuzz".into(),
        id: "r1".into(),
        inputs: vec![
            input("x", "FP32", vec![2, 2]),
            input("ids", "INT64", vec![2, 3]),
        ],
        raw_input_contents: vec![raw_x, raw_ids],
        ..Default::default()
    };
    let seed = request.encode_to_vec();
    let summary = run(&target("grpc", &seed, GRPC), |bytes| {
        let request = pb::ModelInferRequest::decode(bytes)
            .map_err(|e| format!("not a ModelInferRequest: {e}"))?;
        grpc::decode(request, &spec, 8)
            .map(drop)
            .map_err(|e| e.to_string())
    });
    seed_was_valid(&summary, seed.len(), "request decoded");
}

#[test]
fn model_config_files() {
    // Every section and key a model's config.toml can hold, so mutations reach each check.
    let seed = br#"backend = "graph"
graph = "model.kgraph"
kiln_kernels = true
max_batch_size = 8
instances = 2
kind = "KIND_CPU"
max_queue_size = 64
timeout_microseconds = 5000
version_policy = { latest = 2 }
[dynamic_batching]
max_queue_delay_microseconds = 500
preferred_batch_size = [4, 8]
[sequence_batching]
frame_dims = [1, 56, 56]
regions = [[0, 0, 28, 28], [28, 28, 28, 28]]
frame_gate = { threshold = 0.05, max_reuse_age = 30 }
region_gate = { threshold = 0.08, max_reuse_age = 30 }
max_sequence_idle_microseconds = 60000000
max_active_sequences = 16
cascade = [{ graph = "coarse.kgraph", threshold = 0.9 }]
"#;
    let parse = |bytes: &[u8]| {
        let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
        kiln_serve::ModelConfig::parse(text, Path::new("/models/m/1")).map(drop)
    };
    let summary = run(&target("serve-config", seed, SERVE_CONFIG), parse);
    seed_was_valid(&summary, seed.len(), "config parsed");
    // The warm-up block (not allowed beside [sequence_batching]) from a seed of its own.
    let seed = br#"backend = "onnx"
file = "model.onnx"
input_dims = { input_ids = [128] }
passes = "fold"
max_batch_size = 16
version_policy = { specific = [1, 3] }
[warmup]
batch_size = 4
count = 2
data = "random"
"#;
    let summary = run(&target("serve-config-warmup", seed, SERVE_CONFIG), parse);
    seed_was_valid(&summary, seed.len(), "config parsed");
}

#[test]
fn model_control_http_bodies() {
    use kiln_serve::codec::control;
    let seed = br#"{"parameters": {"unload_dependents": false}}"#;
    // A small body, so cheap: more cases, for enough mutations to stay valid JSON.
    let mut body = target("control-http", seed, CONTROL_HTTP);
    body.cases *= 8;
    let summary = run(&body, |bytes| {
        // The same bytes as each of the three bodies the repository extension takes; the
        // input counts as accepted when any of them takes it.
        let index = control::http_index(bytes).map(drop);
        let load = control::http_parameters(bytes, "load").and_then(|p| control::check_load(&p));
        let unload =
            control::http_parameters(bytes, "unload").and_then(|p| control::check_unload(&p));
        index.or(load).or(unload)
    });
    seed_was_valid(&summary, seed.len(), "body accepted");
}

#[test]
fn model_control_grpc_requests() {
    use kiln_serve::codec::control;
    let flag = pb::ModelRepositoryParameter {
        parameter_choice: Some(pb::model_repository_parameter::ParameterChoice::BoolParam(
            true,
        )),
    };
    let request = pb::RepositoryModelUnloadRequest {
        repository_name: String::new(),
        model_name: "w3".into(),
        parameters: [("unload_dependents".to_string(), flag)].into(),
    };
    let seed = request.encode_to_vec();
    // 29 bytes: cheap, and few mutations keep both the protobuf and the parameter valid.
    let mut grpc_target = target("control-grpc", &seed, CONTROL_GRPC);
    grpc_target.cases *= 4;
    let summary = run(&grpc_target, |bytes| {
        let unload = pb::RepositoryModelUnloadRequest::decode(bytes)
            .map_err(|e| format!("not a RepositoryModelUnloadRequest: {e}"))?;
        kiln_serve::repository::check_name(&unload.model_name)?;
        control::check_unload(&control::grpc_parameters(&unload.parameters))
            .map_err(|e| e.to_string())?;
        // Load and unload requests share their field numbers: the same bytes as a load.
        let load = pb::RepositoryModelLoadRequest::decode(bytes)
            .map_err(|e| format!("not a RepositoryModelLoadRequest: {e}"))?;
        let _ = control::check_load(&control::grpc_parameters(&load.parameters));
        Ok::<(), String>(())
    });
    seed_was_valid(&summary, seed.len(), "request accepted");
}
