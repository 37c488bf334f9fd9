#!/usr/bin/env bash
# kiln serve's per-frame stream models under NVIDIA's perf_analyzer: a segmenter (any ONNX
# model with dynamic height and width whose output is a mask) served twice, with the video
# techniques per sequence (frame gate + changed-tile crops) and without (the full model on
# every frame), driven with real frames from a video file as several concurrent sequences.
#
# usage: bench/serve_video.sh VIDEO MODEL.onnx [--size 256x144] [--frames 30]
#                             [--concurrency "1 4"] [--threads N] [--setup]
# Needs a Python with PyAV, NumPy and ONNX Runtime ($KILN_PYTHON) to decode the frames perf_analyzer sends,
# and perf_analyzer ($PERF_ANALYZER, on PATH, or --setup: see bench/perf_analyzer.sh).
# Output: a table and target/serve-video/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -ge 2 ] || { sed -n 2,11p "$0" >&2; exit 2; }
video=$1 model=$2; shift 2
size=256x144 frames=30 concurrency="1 4" threads=2 setup=0 interval=5000
while [ $# -gt 0 ]; do
  case "$1" in
    --size) size=$2; shift 2 ;;
    --frames) frames=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --setup) setup=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
width=${size%x*} height=${size#*x}
py=${KILN_PYTHON:-python3}

. bench/perf_analyzer.sh
cargo build --release -q -p kiln-cli
kiln=./target/release/kiln
work=target/serve-video
rm -rf "$work" && mkdir -p "$work/models/seg_stream" "$work/models/seg_full"
cp "$model" "$work/models/seg_stream/model.onnx"

# The frames as perf_analyzer input data: one sequence per stream, each starting elsewhere in
# the clip, ImageNet-normalized [3, H, W] FP32 in base64.
streams=4
"$py" - "$video" "$width" "$height" "$frames" "$streams" "$model" >"$work/frames.json" <<'PY'
import base64, json, sys
import av, numpy as np, onnxruntime as ort
path, w, h, n, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
std = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
frames = []
with av.open(path) as c:
    for f in c.decode(video=0):
        rgb = f.to_ndarray(width=w, height=h, format="rgb24")
        x = (rgb.transpose(2, 0, 1).astype(np.float32) / 255.0 - mean) / std
        frames.append(base64.b64encode(np.ascontiguousarray(x).tobytes()).decode())
        if len(frames) >= n * streams:
            break
name = ort.InferenceSession(sys.argv[6]).get_inputs()[0].name
data = [[{name: {"b64": frames[(s * n + i) % len(frames)]}} for i in range(n)] for s in range(streams)]
json.dump({"data": data}, sys.stdout)
PY

# Thresholds in normalized units: a luma step of 1/255 is about 1/0.226 of one, so the video
# bench's 0.01 is 0.044 here.
# Both models: the same settings and sequence table; seg_stream adds the techniques.
common="backend = \"onnx\"
max_batch_size = 8
instances = 2
[dynamic_batching]
max_queue_delay_microseconds = 1000
[sequence_batching]
frame_dims = [3, $height, $width]
output = \"mask\""
cat >"$work/models/seg_stream/config.toml" <<TOML
file = "model.onnx"
$common
frame_gate = { threshold = 0.044, max_reuse_age = 60 }
tiles = { threshold = 0.044, margin = 48 }
TOML
cat >"$work/models/seg_full/config.toml" <<TOML
file = "../seg_stream/model.onnx"
$common
TOML

$kiln serve --models "$work/models" --http-port 0 --grpc-port 0 --threads "$threads" \
  >"$work/serve.out" 2>"$work/serve.log" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_for_serve "$work" 300

results="$work/results.jsonl"
: >"$results"
for m in seg_full seg_stream; do
  for c in $concurrency; do
    echo "== $m, $c concurrent sequences of $frames frames" >&2
    csv="$work/$m-c$c.csv"
    if "$pa" -m "$m" -u "$grpc_addr" -i grpc --concurrency-range "$c" -b 1 \
        --input-data "$work/frames.json" --sequence-length "$frames" \
        --measurement-interval "$interval" --max-trials 5 -f "$csv" >"$work/$m-c$c.log" 2>&1 \
        && [ -s "$csv" ]; then
      python3 - "$csv" "$m" "$c" >>"$results" <<'PY'
import csv, json, sys
row = next(csv.DictReader(open(sys.argv[1])))
print(json.dumps({"model": sys.argv[2], "sequences": int(sys.argv[3]),
  "frames_per_s": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
  "p99_us": float(row["p99 latency"]), "compute_us": float(row["Server Compute Infer"])}))
PY
    else
      echo "perf_analyzer failed for $m c$c (see $work/$m-c$c.log)" >&2
    fi
  done
done
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'model':<12}{'seqs':>5}{'frames/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'infer ms':>10}")
for r in rows:
    print(f"{r['model']:<12}{r['sequences']:>5}{r['frames_per_s']:>10.1f}{r['p50_us']/1e3:>9.2f}"
          f"{r['p99_us']/1e3:>9.2f}{r['compute_us']/1e3:>10.2f}")
by = {(r["model"], r["sequences"]): r for r in rows}
for c in sorted({r["sequences"] for r in rows}):
    a, b = by.get(("seg_full", c)), by.get(("seg_stream", c))
    if a and b:
        print(f"{c} sequences: techniques on / off {b['frames_per_s'] / a['frames_per_s']:.2f}x frames/s")
PY
