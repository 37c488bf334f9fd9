"""kiln serve's memory and errors across model reloads under load (BENCHMARKS.md run 49).

Usage: python bench/serve_reload.py --kiln target/release/kiln [--model resnet] [--cycles 5]
       [--clients 4] [--settle 4]

Trains the zoo model for one step, writes its f32 inference graph with `kiln optimize`, and
serves it as version 1 of a versioned model (`kiln serve --model-control-mode explicit`). While
`--clients` tritonclient HTTP threads infer without pause, it loads a new version `--cycles`
times (each a fresh copy of the graph: a new version directory, a load request), then offers a
broken version (a truncated graph), sampling the server's resident memory (VmRSS) every 50 ms.
Reports, per phase: the load request's latency, the RSS peak while old and new versions
coexist, the RSS plateau once the old version has drained, the requests answered and failed,
and which versions answered. Needs tritonclient[http] and numpy (the CI venv has both).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--settle", type=float, default=4.0)
    args = ap.parse_args()
    kiln = os.path.abspath(args.kiln)
    work = tempfile.mkdtemp(prefix="kiln-reload-")
    try:
        run(args, kiln, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, kiln, work):
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    subprocess.run([kiln, "train", "--model", args.model, "--max-steps", "1", "--batch-size", "8",
                    "--checkpoint-dir", f"{work}/ckpt"], **quiet)
    subprocess.run([kiln, "optimize", "--model", args.model, "--checkpoint", f"{work}/ckpt",
                    "--passes", "strip,fold", "--steps", "1", "--out", f"{work}/opt"], **quiet)
    graph = f"{work}/opt/model.kgraph"
    size_mib = os.path.getsize(graph) / 2**20
    model_dir = f"{work}/repo/m"
    os.makedirs(f"{model_dir}/1")
    shutil.copy(graph, f"{model_dir}/1/model.kgraph")
    with open(f"{model_dir}/config.toml", "w") as f:
        f.write('backend = "graph"\ngraph = "model.kgraph"\nmax_batch_size = 8\n'
                '[dynamic_batching]\nmax_queue_delay_microseconds = 1000\n[warmup]\nbatch_size = 8\n')
    server = subprocess.Popen([kiln, "serve", "--models", f"{work}/repo", "--model-control-mode",
                               "explicit", "--load-model", "m", "--http-port", "0", "--no-grpc"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        url = line.split()[3]
        measure(args, server.pid, url, model_dir, graph, size_mib)
    finally:
        server.terminate()
        server.wait(timeout=60)


def measure(args, pid, url, model_dir, graph, size_mib):
    samples = []  # (time, rss MiB)
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            samples.append((time.monotonic(), rss_mib(pid)))
            time.sleep(0.05)

    answers, errors, times = {}, [], []
    lock = threading.Lock()
    x = np.random.default_rng(0).random((1, 1, 28, 28), dtype=np.float32)

    def client():
        c = httpclient.InferenceServerClient(url)
        while not stop.is_set():
            inp = httpclient.InferInput("images", [1, 1, 28, 28], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            try:
                v = c.infer("m", [inp]).get_response()["model_version"]
                with lock:
                    answers[v] = answers.get(v, 0) + 1
                    times.append(time.monotonic())
            except InferenceServerException as e:
                with lock:
                    errors.append(str(e))

    def window(t0, t1):
        return [r for t, r in samples if t0 <= t <= t1]

    def rate(t0, t1):
        with lock:
            return sum(t0 <= t <= t1 for t in times) / (t1 - t0)

    threads = [threading.Thread(target=sampler)] + [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    control = httpclient.InferenceServerClient(url)
    rows = []
    try:
        time.sleep(2 * args.settle)
        now = time.monotonic()
        rows.append({"phase": "v1 serving", "load_ms": None, "peak": max(window(now - args.settle, now)),
                     "plateau": statistics.median(window(now - args.settle / 2, now)),
                     "rps": rate(now - args.settle, now)})
        for v in range(2, args.cycles + 2):
            os.makedirs(f"{model_dir}/{v}")
            shutil.copy(graph, f"{model_dir}/{v}/model.kgraph")
            t0 = time.monotonic()
            control.load_model("m")
            load_ms = (time.monotonic() - t0) * 1e3
            time.sleep(args.settle)
            now = time.monotonic()
            rows.append({"phase": f"load v{v}", "load_ms": load_ms, "peak": max(window(t0, now)),
                         "plateau": statistics.median(window(now - args.settle / 2, now)),
                         "rps": rate(t0, now)})
        broken = args.cycles + 2
        os.makedirs(f"{model_dir}/{broken}")
        with open(graph, "rb") as f:
            data = f.read()
        with open(f"{model_dir}/{broken}/model.kgraph", "wb") as f:
            f.write(data[: len(data) // 3])
        t0 = time.monotonic()
        try:
            control.load_model("m")
            refused = False
        except InferenceServerException:
            refused = True
        load_ms = (time.monotonic() - t0) * 1e3
        time.sleep(args.settle)
        now = time.monotonic()
        rows.append({"phase": f"broken v{broken} offered ({'refused' if refused else 'ACCEPTED'})",
                     "load_ms": load_ms, "peak": max(window(t0, now)),
                     "plateau": statistics.median(window(now - args.settle / 2, now)),
                     "rps": rate(t0, now)})
    finally:
        stop.set()
        for t in threads:
            t.join()
    served = sum(answers.values())
    print(f"model {args.model}: graph {size_mib:.1f} MiB, {args.clients} HTTP clients, "
          f"{served} requests answered, {len(errors)} failed; answers per version {dict(sorted(answers.items()))}")
    print("| phase | load request ms | requests/s | RSS peak MiB (old + new) | RSS plateau MiB (after drain) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        load = "–" if r["load_ms"] is None else f"{r['load_ms']:.0f}"
        print(f"| {r['phase']} | {load} | {r['rps']:.0f} | {r['peak']:.1f} | {r['plateau']:.1f} |")
    print(json.dumps({"rows": rows, "answers": answers, "failed": len(errors), "errors": errors[:5]}))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
