"""Model control with NVIDIA's own clients (tritonclient, HTTP and gRPC), under load.

Usage: python tritonclient_control.py HTTP_HOST:PORT GRPC_HOST:PORT REPOSITORY

The server runs in explicit model control mode with `w3` loaded: REPOSITORY/w3/config.toml (a
versioned W3 graph model, latest-1 policy) and REPOSITORY/w3/1. Staged beside them, hidden
(so the server ignores them): w3/.v2 (a good new version) and w3/.v3 (a broken one).
REPOSITORY/inputs.f32 holds K images of 1x28x28, little-endian float32.

While four threads (two HTTP, two gRPC) infer without pause, this script moves .v2 into place
and loads it (HTTP load_model), then offers the broken .v3 (gRPC load_model, which must fail),
then stops the clients and unloads the model. It checks the index at each step and that no
request failed, and writes every answer (input, version, logits) to REPOSITORY/answers.json
for the Rust test to check against each version's own output. Exits non-zero naming the first
thing that differed.
"""
import json
import os
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")


def index(client):
    """(version, state) rows of w3 in the repository index, via tritonclient's HTTP call."""
    rows = client.get_model_repository_index()
    return sorted((r.get("version", ""), r["state"], r.get("reason", "")) for r in rows if r["name"] == "w3")


def main():
    http_url, grpc_url, repo = sys.argv[1], sys.argv[2], sys.argv[3]
    images = np.fromfile(os.path.join(repo, "inputs.f32"), dtype="<f4").reshape(-1, 1, 1, 28, 28)
    http = httpclient.InferenceServerClient(http_url)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    check(http.is_model_ready("w3"), "w3 ready at start")
    check([r[:2] for r in index(http)] == [("1", "READY")], f"index at start: {index(http)}")

    stop = threading.Event()
    answers, errors = [], []
    lock = threading.Lock()

    def client_loop(kind, worker):
        c = httpclient.InferenceServerClient(http_url) if kind == "http" else grpcclient.InferenceServerClient(grpc_url)
        mod = httpclient if kind == "http" else grpcclient
        i = worker
        while not stop.is_set():
            k = i % len(images)
            i += 4
            inp = mod.InferInput("images", [1, 1, 28, 28], "FP32")
            inp.set_data_from_numpy(images[k])
            try:
                r = c.infer("w3", [inp])
            except InferenceServerException as e:
                with lock:
                    errors.append(f"{kind}: {e}")
                continue
            resp = r.get_response()
            version = resp["model_version"] if kind == "http" else resp.model_version
            with lock:
                answers.append({"input": k, "version": version, "logits": r.as_numpy("logits")[0].tolist()})

    threads = [
        threading.Thread(target=client_loop, args=(kind, w))
        for w, kind in enumerate(["http", "grpc", "http", "grpc"])
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        # A new version: moved into place, then loaded while the clients keep sending.
        os.rename(os.path.join(repo, "w3", ".v2"), os.path.join(repo, "w3", "2"))
        http.load_model("w3")
        check([r[:2] for r in index(http)] == [("2", "READY")], f"index after loading 2: {index(http)}")
        check(http.is_model_ready("w3", "2") and not http.is_model_ready("w3", "1"), "2 ready, 1 retired")
        time.sleep(0.5)
        # A broken version: the load fails with the reason and version 2 keeps serving.
        os.rename(os.path.join(repo, "w3", ".v3"), os.path.join(repo, "w3", "3"))
        try:
            grpc.load_model("w3")
            check(False, "loading the broken version 3 succeeded")
        except InferenceServerException as e:
            check("version 3" in str(e), f"the load error names version 3: {e}")
        rows = index(http)
        check([r[:2] for r in rows] == [("2", "READY"), ("3", "UNAVAILABLE")], f"index after the broken offer: {rows}")
        check(rows[1][2] != "", "version 3 is listed with its reason")
        grpc_rows = grpc.get_model_repository_index(as_json=True)["models"]
        check(any(r["name"] == "w3" and r.get("version") == "3" and r.get("reason") for r in grpc_rows), f"gRPC index: {grpc_rows}")
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()

    check(not errors, f"{len(errors)} failed requests, first: {errors[:3]}")
    versions = sorted({a["version"] for a in answers})
    check(versions == ["1", "2"], f"answered by versions {versions}")
    # Unload over gRPC: the model stops serving and says why.
    grpc.unload_model("w3")
    check(not http.is_model_ready("w3"), "w3 not ready after unload")
    check([r[1:] for r in index(http)] == [("UNAVAILABLE", "unloaded")], f"index after unload: {index(http)}")
    with open(os.path.join(repo, "answers.json"), "w") as f:
        json.dump(answers, f)
    counts = {v: sum(a["version"] == v for a in answers) for v in versions}
    print(f"tritonclient control: OK ({len(answers)} requests, per version {counts}, 0 failed)")


if __name__ == "__main__":
    main()
