//! Protocol conformance with NVIDIA's own clients: `tritonclient` (PyPI), HTTP and gRPC,
//! drives kiln-serve unmodified (tests/tritonclient_conformance.py). Skips with a message only
//! when tritonclient is not importable and `KILN_REQUIRE_TRITONCLIENT` is unset; CI installs
//! it and sets the variable, so there it always runs.

mod common;

use std::process::Command;

use common::{TestServer, tempdir, write_cnn_model, write_model};

#[test]
fn tritonclient_http_and_grpc_drive_kiln_serve() {
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
        return;
    }
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
