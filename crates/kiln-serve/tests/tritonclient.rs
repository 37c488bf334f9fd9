//! Protocol conformance with NVIDIA's own clients: `tritonclient` (PyPI), HTTP and gRPC,
//! drives kiln-serve unmodified (tests/tritonclient_conformance.py), and controls its models
//! under load (tests/tritonclient_control.py). Skips with a message only when tritonclient is
//! not importable and `KILN_REQUIRE_TRITONCLIENT` is unset; CI installs it and sets the
//! variable, so there it always runs.

mod common;

use std::process::Command;
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use common::{TestServer, images, tempdir, write_cnn_graph, write_cnn_model, write_model};
use kiln::infer::{InferenceSession, load_graph};
use kiln_serve::{ModelControlMode, RepositoryOptions, Stages};

/// The Python that imports tritonclient, or `None` after saying SKIPPED (a failure where
/// `KILN_REQUIRE_TRITONCLIENT` is set).
fn tritonclient_python() -> Option<String> {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let importable = Command::new(&python)
        .args(["-c", "import tritonclient.http, tritonclient.grpc, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !importable {
        assert!(
            std::env::var_os("KILN_REQUIRE_TRITONCLIENT").is_none(),
            "KILN_REQUIRE_TRITONCLIENT is set but `{python} -c 'import tritonclient.http, tritonclient.grpc'` fails"
        );
        eprintln!(
            "SKIPPED: tritonclient is not importable by `{python}` \
             (pip install 'tritonclient[http,grpc]' numpy, or set KILN_PYTHON)"
        );
        return None;
    }
    Some(python)
}

#[test]
fn tritonclient_http_and_grpc_drive_kiln_serve() {
    let Some(python) = tritonclient_python() else {
        return;
    };
    let repo = tempdir("tritonclient");
    write_cnn_model(
        &repo,
        "w3",
        "max_batch_size = 16\n[dynamic_batching]\nmax_queue_delay_microseconds = 2000\n",
    );
    write_model(
        &repo,
        "id64",
        "backend = \"identity\"\ndims = [3]\ndatatype = \"INT64\"\n",
    );
    write_cnn_model(
        &repo,
        "cam",
        "max_batch_size = 8\n[sequence_batching]\nframe_dims = [1, 56, 56]\n\
         regions = [[0, 0, 28, 28], [28, 0, 28, 28], [0, 28, 28, 28], [28, 28, 28, 28]]\n\
         region_gate = { threshold = 0.01, max_reuse_age = 30 }\n",
    );
    write_model(
        &repo,
        "broken",
        "backend = \"graph\"\ngraph = \"missing.kgraph\"\n",
    );
    let server = TestServer::start(&repo);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/tritonclient_conformance.py"
    );
    let out = Command::new(&python)
        .arg(script)
        .arg(server.http.to_string())
        .arg(server.grpc.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "conformance failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("tritonclient conformance: OK") && stdout.contains("sequences http + grpc"),
        "{stdout}"
    );
    let m = &server.model("w3").metrics;
    assert!(m.success.load(std::sync::atomic::Ordering::Relaxed) >= 60);
}

/// The repository extension through tritonclient while four of its clients (HTTP and gRPC
/// threads) infer: a new version loads, a broken one is refused, the model unloads. No request
/// fails, and every answer equals what the version that answered computes alone.
#[test]
fn tritonclient_loads_and_unloads_models_under_load() {
    let Some(python) = tritonclient_python() else {
        return;
    };
    let repo = tempdir("tritonclient-control");
    write_model(
        &repo,
        "w3",
        "backend = \"graph\"\ngraph = \"model.kgraph\"\nmax_batch_size = 8\n\
         [dynamic_batching]\nmax_queue_delay_microseconds = 1000\n[warmup]\nbatch_size = 4\n",
    );
    let w3 = repo.join("w3");
    for dir in ["1", ".v2", ".v3"] {
        std::fs::create_dir_all(w3.join(dir)).unwrap();
    }
    write_cnn_graph(&w3.join("1/model.kgraph"));
    write_cnn_graph(&w3.join(".v2/model.kgraph"));
    let good = std::fs::read(w3.join(".v2/model.kgraph")).unwrap();
    std::fs::write(w3.join(".v3/model.kgraph"), &good[..good.len() / 2]).unwrap();
    let inputs = 16;
    let pixels = images(42, inputs);
    let bytes: Vec<u8> = pixels.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(repo.join("inputs.f32"), bytes).unwrap();
    let options = RepositoryOptions {
        stages: Stages::staged(1),
        mode: ModelControlMode::Explicit,
        startup_models: vec!["w3".into()],
        drain_timeout: Duration::from_secs(30),
        ..RepositoryOptions::default()
    };
    let server = TestServer::start_options(&repo, kiln_serve::MAX_BODY_BYTES, options);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tritonclient_control.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(server.http.to_string())
        .arg(server.grpc.to_string())
        .arg(repo.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "control failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("tritonclient control: OK"), "{stdout}");
    eprintln!("{}", stdout.trim());
    // Every answer is what its version computes on that input alone.
    let device = Device::flex();
    let session = |v: &str| {
        InferenceSession::from_graph(
            load_graph(&w3.join(v).join("model.kgraph")).unwrap(),
            &device,
        )
        .unwrap()
    };
    let sessions = [session("1"), session("2")];
    let reference = |v: usize, k: usize| -> Vec<f32> {
        let x: Tensor<4> = Tensor::from_data(
            TensorData::new(pixels[k * 784..(k + 1) * 784].to_vec(), [1, 1, 28, 28]),
            &device,
        );
        sessions[v]
            .forward(x)
            .unwrap()
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap()
    };
    let references: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|v| (0..inputs).map(|k| reference(v, k)).collect())
        .collect();
    let answers: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo.join("answers.json")).unwrap()).unwrap();
    let answers = answers.as_array().unwrap();
    assert!(!answers.is_empty());
    for a in answers {
        let v: usize = a["version"].as_str().unwrap().parse().unwrap();
        let k = a["input"].as_u64().unwrap() as usize;
        let logits: Vec<f32> = a["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let expected = &references[v - 1][k];
        for (got, want) in logits.iter().zip(expected) {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "version {v}, input {k}: {got} vs {want}"
            );
        }
    }
    assert!(
        references[0][0] != references[1][0],
        "versions 1 and 2 compute the same: the check could not tell them apart"
    );
}
