#!/usr/bin/env bash
# kiln serve under NVIDIA's perf_analyzer: W3 (the Kiln CNN, f32 graph) with dynamic
# batching off and on over a concurrency sweep, plus the per-request overhead of the server
# on a trivial (identity) model. One invocation measures everything back to back.
#
# usage: bench/serve_perf.sh [--protocol grpc|http] [--concurrency "1 4 16 64"] [--interval MS]
#                            [--threads N] [--stage-threads N] [--inline-bytes N] [--delay US] [--setup]
# perf_analyzer: $PERF_ANALYZER, or `perf_analyzer` on PATH, or --setup installs it into
# ${TMPDIR:-/tmp}/kiln-perf-venv (tritonclient 2.50.0 is the last PyPI wheel that ships the
# binary; it needs Debian's libb64-0d and PyPI's nvidia-cuda-runtime-cu12, nothing else of CUDA).
# Output: a table per model and a JSON-lines file (target/serve-bench/results.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."

protocol=grpc concurrency="1 4 16 64" interval=3000 threads=2 stage_threads=1 inline_bytes=16384 delay=100 setup=0
while [ $# -gt 0 ]; do
  case "$1" in
    --protocol) protocol=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --interval) interval=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --stage-threads) stage_threads=$2; shift 2 ;;
    --inline-bytes) inline_bytes=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --setup) setup=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

. bench/perf_analyzer.sh   # sets $pa (installs it with --setup); the cwd is the repo root

work=target/serve-bench
rm -rf "$work" && mkdir -p "$work/models"
. bench/w3_graph.sh        # sets $kiln, defines w3_graph
w3_graph "$work" "$work/models/w3_batching"
cat >"$work/models/w3_batching/config.toml" <<TOML
backend = "graph"
graph = "model.kgraph"
max_batch_size = 64
max_queue_size = 4096
[dynamic_batching]
max_queue_delay_microseconds = $delay
TOML
mkdir -p "$work/models/w3_no_batching" "$work/models/trivial"
cat >"$work/models/w3_no_batching/config.toml" <<'TOML'
backend = "graph"
graph = "../w3_batching/model.kgraph"
max_batch_size = 64
max_queue_size = 4096
TOML
cat >"$work/models/trivial/config.toml" <<'TOML'
backend = "identity"
dims = [16]
max_batch_size = 1
TOML

$kiln serve --models "$work/models" --http-port 0 --grpc-port 0 --threads "$threads" \
  --stage-threads "$stage_threads" --inline-bytes "$inline_bytes" \
  >"$work/serve.out" 2>"$work/serve.log" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_for_serve "$work" 200
if [ "$protocol" = grpc ]; then url=$grpc_addr; else url=$http_addr; fi
echo "== kiln serve (stage threads $stage_threads, inline up to $inline_bytes bytes, batching delay $delay us): http $http_addr grpc $grpc_addr; perf_analyzer over $protocol" >&2

results="$work/results.jsonl"
: >"$results"
run() { # model concurrency
  local csv="$work/$1-c$2.csv"
  if "$pa" -m "$1" -u "$url" -i "$protocol" --concurrency-range "$2" -b 1 \
      --measurement-interval "$interval" -s 50 --max-trials 5 -f "$csv" >"$work/$1-c$2.log" 2>&1 \
      && [ -s "$csv" ]; then
    python3 - "$csv" "$1" "$2" >>"$results" <<'PY'
import csv, json, sys
row = next(csv.DictReader(open(sys.argv[1])))
us = lambda k: float(row[k])
print(json.dumps({"model": sys.argv[2], "concurrency": int(sys.argv[3]),
  "throughput": float(row["Inferences/Second"]), "p50_us": us("p50 latency"),
  "p95_us": us("p95 latency"), "p99_us": us("p99 latency"), "queue_us": us("Server Queue"),
  "compute_us": us("Server Compute Infer")}))
PY
  else
    echo "perf_analyzer failed for $1 c$2 (see $work/$1-c$2.log)" >&2
  fi
}
for m in w3_no_batching w3_batching; do
  for c in $concurrency; do echo "== $m concurrency $c" >&2; run "$m" "$c"; done
done
echo "== trivial model, concurrency 1" >&2
run trivial 1
stats=$(curl -s "http://$http_addr/v2/models/trivial/stats")

python3 - "$results" "$stats" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'model':<16}{'conc':>5}{'infer/s':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'queue ms':>10}{'infer ms':>10}")
for r in rows:
    print(f"{r['model']:<16}{r['concurrency']:>5}{r['throughput']:>10.1f}{r['p50_us']/1e3:>9.2f}"
          f"{r['p95_us']/1e3:>9.2f}{r['p99_us']/1e3:>9.2f}{r['queue_us']/1e3:>10.2f}{r['compute_us']/1e3:>10.2f}")
by = {(r["model"], r["concurrency"]): r for r in rows}
for c in sorted({r["concurrency"] for r in rows}):
    a, b = by.get(("w3_no_batching", c)), by.get(("w3_batching", c))
    if a and b:
        print(f"concurrency {c}: batching on / off throughput {b['throughput']/a['throughput']:.2f}x, "
              f"p99 {b['p99_us']/1e3:.2f} vs {a['p99_us']/1e3:.2f} ms")
s = json.loads(sys.argv[2])["model_stats"][0]["inference_stats"]
n = max(int(s["success"]["count"]), 1)
print(f"trivial model: server time per request {int(s['success']['ns'])/n/1e3:.1f} us "
      f"(decode {int(s['compute_input']['ns'])/n/1e3:.1f}, queue {int(s['queue']['ns'])/n/1e3:.1f}, "
      f"execute {int(s['compute_infer']['ns'])/n/1e3:.1f}, encode {int(s['compute_output']['ns'])/n/1e3:.1f}) over {n} requests")
PY
