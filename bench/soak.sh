#!/usr/bin/env bash
# Soak test: kiln serve (W3, dynamic batching) under NVIDIA's perf_analyzer at 4x its
# saturation concurrency for N minutes. Reports per minute: throughput, p50/p99 latency and
# the server's resident memory; at the end: requests answered, failures by reason, in-flight
# gauge, and the memory growth from the first to the last minute. Not part of `cargo test`.
#
# usage: bench/soak.sh [--minutes 10] [--concurrency C (default: 4x measured saturation)]
#                      [--protocol grpc|http] [--threads 2] [--setup]
# perf_analyzer: as in bench/serve_perf.sh ($PERF_ANALYZER, PATH, or --setup).
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=10 concurrency="" protocol=grpc threads=2 setup=0
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --protocol) protocol=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --setup) setup=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

. bench/perf_analyzer.sh   # sets $pa (installs it with --setup); the cwd is the repo root

work=target/soak
rm -rf "$work" && mkdir -p "$work/models/w3"
. bench/w3_graph.sh        # sets $kiln, defines w3_graph
w3_graph "$work" "$work/opt"
cp "$work/opt/model.kgraph" "$work/models/w3/"
# The queue holds every request perf_analyzer can have outstanding, so overload shows as
# queueing latency; a request the server could not take would be a 429 and count as lost.
cat >"$work/models/w3/config.toml" <<'TOML'
backend = "graph"
graph = "model.kgraph"
max_batch_size = 64
max_queue_size = 4096
[dynamic_batching]
max_queue_delay_microseconds = 100
TOML

$kiln serve --models "$work/models" --http-port 0 --grpc-port 0 --threads "$threads" \
  >"$work/serve.out" 2>"$work/serve.log" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_for_serve "$work" 200
if [ "$protocol" = grpc ]; then url=$grpc_addr; else url=$http_addr; fi

# One perf_analyzer measurement: $1 concurrency, $2 window ms, $3 windows, $4 csv.
# Stability 999% accepts the first windows as they come, so the duration is fixed.
measure() {
  "$pa" -m w3 -u "$url" -i "$protocol" --concurrency-range "$1" -b 1 \
    --measurement-interval "$2" -s 999 --max-trials "$3" -f "$4" >"$4.log" 2>&1
}
field() { # csv column
  python3 -c 'import csv,sys; r=next(csv.DictReader(open(sys.argv[1]))); print(r[sys.argv[2]])' "$1" "$2"
}
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$server/status"; }

if [ -z "$concurrency" ]; then
  echo "== saturation sweep (3 s per concurrency)" >&2
  best=0 sat=1
  for c in 1 2 4 8 16 32; do
    measure "$c" 3000 3 "$work/sweep-c$c.csv"
    t=$(field "$work/sweep-c$c.csv" "Inferences/Second")
    echo "   concurrency $c: $t infer/s" >&2
    # Saturated: the first concurrency within 5% of the best throughput seen.
    if python3 -c "import sys; sys.exit(0 if $t > $best * 1.05 else 1)"; then best=$t sat=$c; fi
  done
  concurrency=$((sat * 4))
  echo "   saturation at concurrency $sat ($best infer/s); soaking at $concurrency" >&2
fi

echo "minute,concurrency,infer_per_s,p50_ms,p99_ms,rss_mib" >"$work/soak.csv"
for m in $(seq "$minutes"); do
  measure "$concurrency" 20000 3 "$work/minute-$m.csv"
  t=$(field "$work/minute-$m.csv" "Inferences/Second")
  p50=$(field "$work/minute-$m.csv" "p50 latency")
  p99=$(field "$work/minute-$m.csv" "p99 latency")
  rss=$(rss_kib)
  printf '%s,%s,%s,%.2f,%.2f,%.1f\n' "$m" "$concurrency" "$t" "$(echo "$p50/1000" | bc -l)" \
    "$(echo "$p99/1000" | bc -l)" "$(echo "$rss/1024" | bc -l)" >>"$work/soak.csv"
  tail -1 "$work/soak.csv" >&2
done

curl -s "http://$http_addr/metrics" >"$work/metrics.txt"
python3 - "$work/soak.csv" "$work/metrics.txt" <<'PY'
import csv, re, sys
rows = list(csv.DictReader(open(sys.argv[1])))
metrics = open(sys.argv[2]).read()
def metric(name, **labels):
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
print(f"{'minute':>6}{'conc':>6}{'infer/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'RSS MiB':>9}")
for r in rows:
    print(f"{r['minute']:>6}{r['concurrency']:>6}{float(r['infer_per_s']):>10.1f}"
          f"{float(r['p50_ms']):>9.2f}{float(r['p99_ms']):>9.2f}{float(r['rss_mib']):>9.1f}")
ok = metric("kiln_request_success_total", model="w3")
failed = {m.group(1): float(m.group(2)) for m in
          re.finditer(r'kiln_request_failure_total\{model="w3",reason="(\w+)"\} (\S+)', metrics)}
inflight = metric("kiln_inflight_requests", model="w3")
rss = [float(r["rss_mib"]) for r in rows]
p99 = [float(r["p99_ms"]) for r in rows]
print(f"answered 200: {ok:.0f}; failures by reason: {failed}; in flight after: {inflight:.0f}")
print(f"RSS first minute {rss[0]:.1f} MiB, last {rss[-1]:.1f} MiB (growth {rss[-1] - rss[0]:+.1f}); "
      f"p99 min {min(p99):.2f} / max {max(p99):.2f} ms")
PY
