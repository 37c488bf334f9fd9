"""Drives kiln-serve with NVIDIA's own Python clients (tritonclient, HTTP and gRPC), unmodified.

Usage: python tritonclient_conformance.py HTTP_HOST:PORT GRPC_HOST:PORT
Models expected: `w3` (Kiln CNN graph, images [-1,1,28,28] -> logits [-1,10], label [-1,1]),
`id64` (identity, INT64 [-1,3]), `broken` (fails to load) and `cam` (a stream model over a CNN:
frames [1,56,56], four 28x28 regions gated by change, the sequence extension). Exits non-zero on the first
mismatch with a message saying what differed.
"""
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")


def run(mod, url, binary):
    name = mod.__name__.split(".")[-1]
    c = mod.InferenceServerClient(url)
    check(c.is_server_live(), f"{name}: server live")
    check(c.is_server_ready(), f"{name}: server ready")
    check(c.is_model_ready("w3"), f"{name}: w3 ready")
    check(not c.is_model_ready("broken"), f"{name}: broken not ready")
    meta = c.get_server_metadata()
    server_name = meta["name"] if isinstance(meta, dict) else meta.name
    check(server_name == "kiln-serve", f"{name}: server name {server_name}")
    md = c.get_model_metadata("w3", as_json=True) if name == "grpc" else c.get_model_metadata("w3")
    check(md["inputs"][0]["name"] == "images", f"{name}: input name {md}")
    check([int(d) for d in md["inputs"][0]["shape"]] == [-1, 1, 28, 28], f"{name}: input shape {md}")
    cfg = c.get_model_config("w3", as_json=True) if name == "grpc" else c.get_model_config("w3")
    cfg = cfg.get("config", cfg)
    check(int(cfg["max_batch_size"]) == 16, f"{name}: max_batch_size {cfg}")

    rng = np.random.default_rng(0)
    x = rng.random((3, 1, 28, 28), dtype=np.float32)

    def infer(batch, outputs=None):
        inp = mod.InferInput("images", list(batch.shape), "FP32")
        if name == "http":
            inp.set_data_from_numpy(batch, binary_data=binary)
        else:
            inp.set_data_from_numpy(batch)
        return c.infer("w3", [inp], outputs=outputs)

    together = infer(x)
    logits = together.as_numpy("logits")
    labels = together.as_numpy("label")
    check(logits.shape == (3, 10) and logits.dtype == np.float32, f"{name}: logits {logits.shape}")
    check(labels.shape == (3, 1) and labels.dtype == np.int64, f"{name}: labels {labels.shape}")
    check((labels.ravel() == logits.argmax(axis=1)).all(), f"{name}: label is the arg-max")
    for i in range(3):
        alone = infer(x[i : i + 1]).as_numpy("logits")
        check(np.allclose(alone[0], logits[i], rtol=1e-5, atol=1e-5), f"{name}: row {i} alone vs batched")

    if name == "http":
        out = [httpclient.InferRequestedOutput("label", binary_data=binary)]
    else:
        out = [grpcclient.InferRequestedOutput("label")]
    only = infer(x, outputs=out)
    check(only.as_numpy("logits") is None, f"{name}: only the requested output returned")
    check((only.as_numpy("label") == labels).all(), f"{name}: requested label")

    v = np.array([[1, -2, 3], [2**62, 5, -(2**62)]], dtype=np.int64)
    inp = mod.InferInput("INPUT0", [2, 3], "INT64")
    if name == "http":
        inp.set_data_from_numpy(v, binary_data=binary)
    else:
        inp.set_data_from_numpy(v)
    back = c.infer("id64", [inp]).as_numpy("OUTPUT0")
    check(back is not None and (back == v).all(), f"{name}: INT64 identity round trip {back}")

    try:
        infer(np.zeros((1, 1, 28, 27), dtype=np.float32))
        check(False, f"{name}: wrong shape accepted")
    except InferenceServerException as e:
        check("expects" in str(e), f"{name}: wrong-shape message {e}")
    try:
        c.infer("nope", [mod.InferInput("images", [1, 1, 28, 28], "FP32")])
        check(False, f"{name}: unknown model accepted")
    except InferenceServerException as e:
        check("unknown model" in str(e), f"{name}: unknown-model message {e}")

    stats = c.get_inference_statistics("w3", as_json=True) if name == "grpc" else c.get_inference_statistics("w3")
    s = stats["model_stats"][0]
    check(int(s["inference_count"]) >= 9, f"{name}: inference_count {s}")
    return logits


def run_sequences(mod, url, seq_a, seq_b):
    """The sequence extension through tritonclient's own sequence_id / start / end arguments:
    unchanged regions come back reused, a changed one computed, two sequences independent,
    and a sequence never started refused."""
    name = mod.__name__.split(".")[-1]
    c = mod.InferenceServerClient(url)
    cfg = c.get_model_config("cam", as_json=True) if name == "grpc" else c.get_model_config("cam")
    cfg = cfg.get("config", cfg)
    check("sequence_batching" in cfg, f"{name}: the stream model's config has sequence_batching {cfg}")
    rng = np.random.default_rng(2)
    base = rng.random((1, 1, 56, 56), dtype=np.float32)
    changed = base.copy()
    changed[0, 0, :28, :28] = rng.random((28, 28), dtype=np.float32)

    def frame(x, seq, start=False, end=False):
        inp = mod.InferInput("images", [1, 1, 56, 56], "FP32")
        inp.set_data_from_numpy(x)
        r = c.infer("cam", [inp], sequence_id=seq, sequence_start=start, sequence_end=end)
        return r.as_numpy("label").ravel(), r.as_numpy("fresh").ravel()

    first, fresh = frame(base, seq_a, start=True)
    check(fresh.tolist() == [1, 1, 1, 1], f"{name}: first frame computes every region {fresh}")
    other, fresh_b = frame(changed, seq_b, start=True)
    check(fresh_b.tolist() == [1, 1, 1, 1], f"{name}: another sequence has its own state {fresh_b}")
    again, fresh = frame(base, seq_a)
    check(fresh.tolist() == [0, 0, 0, 0], f"{name}: an unchanged frame reuses {fresh}")
    check((again == first).all(), f"{name}: reused labels are the first frame's")
    moved, fresh = frame(changed, seq_a, end=True)
    check(fresh.tolist() == [1, 0, 0, 0], f"{name}: only the changed region runs {fresh}")
    check((moved == other).all(), f"{name}: same frame, same labels across sequences")
    frame(changed, seq_b, end=True)
    try:
        frame(base, seq_a)
        check(False, f"{name}: a frame after sequence_end accepted")
    except InferenceServerException as e:
        check("not active" in str(e), f"{name}: ended-sequence message {e}")


def run_async_http(url):
    """Concurrent async requests through one client: every answer is its own request's."""
    c = httpclient.InferenceServerClient(url, concurrency=8)
    rng = np.random.default_rng(1)
    xs = [rng.random((1 + i % 3, 1, 28, 28), dtype=np.float32) for i in range(24)]
    pending = []
    for x in xs:
        inp = httpclient.InferInput("images", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        pending.append(c.async_infer("w3", [inp]))
    results = [p.get_result().as_numpy("logits") for p in pending]
    for x, got in zip(xs, results):
        inp = httpclient.InferInput("images", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        alone = c.infer("w3", [inp]).as_numpy("logits")
        check(np.allclose(alone, got, rtol=1e-5, atol=1e-5), "http async: batched answer differs from alone")
    c.close()


def main():
    http_url, grpc_url = sys.argv[1], sys.argv[2]
    a = run(httpclient, http_url, binary=True)
    b = run(httpclient, http_url, binary=False)
    g = run(grpcclient, grpc_url, binary=True)
    check(np.allclose(a, b, rtol=1e-6) and np.allclose(a, g, rtol=1e-6), "HTTP binary, HTTP JSON and gRPC agree")
    run_async_http(http_url)
    run_sequences(httpclient, http_url, 11, "cam-b")
    run_sequences(grpcclient, grpc_url, "cam-a", 12)
    print("tritonclient conformance: OK (http binary, http json, grpc, http async x24, sequences http + grpc)")


if __name__ == "__main__":
    main()
