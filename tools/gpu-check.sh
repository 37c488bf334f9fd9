#!/usr/bin/env bash
# Kiln's checks on a machine with an NVIDIA GPU, from what tools/gpu-pack.sh packed into
# .gpu/: the plan on cuda, the GPU tests (Burn's device collective under data parallelism,
# the watermark on device memory), the main job and `kiln optimize --device cuda` with the
# f16 pass, then the benchmarks: Kiln f32/bf16/f16 training on the GPU beside PyTorch (same
# shapes, f32 and bf16 autocast), the fusion A/B (the `cuda-eager` build), the autotune A/B
# (CUBECL_AUTOTUNE_LEVEL) and W3 inference on the GPU. Every step has a time limit and
# writes to $OUT (default /tmp/kiln-gpu), so a slow step costs its limit, not the lease.
#
# usage: tools/gpu-check.sh [quick]     (quick: the checks without the benchmarks)
set -u
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kiln-gpu}"
mkdir -p "$out"
log="$out/gpu-check.log"
exec > >(tee -a "$log") 2>&1
bin=/tmp/kiln-gpu-bin
mkdir -p "$bin"
for f in .gpu/bin/*.xz; do xz -dc "$f" >"$bin/$(basename "$f" .xz)"; done
chmod +x "$bin"/*
# The libraries packed beside the binaries, CUDA's own (NVRTC) and the NCCL that PyTorch's
# wheels bring (cudarc loads both at run time).
extra=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
for s in site.getsitepackages():
    dirs += glob.glob(os.path.join(s, "nvidia", "*", "lib"))
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="$PWD/.gpu/lib:/usr/local/cuda/lib64:${extra}:${LD_LIBRARY_PATH:-}"
step() { # step NAME SECONDS CMD...: runs CMD with a limit, reports its status and time
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" >&2
  local t0=$SECONDS rc
  timeout "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc in $((SECONDS - t0))s" >&2
  return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
ldd "$bin/kiln" | grep "not found"
lscpu | grep -E 'Model name|^CPU\(s\)'
kiln="$bin/kiln"
step plan 60 "$kiln" plan --device cuda --level advanced --set train.data_parallel=gpus ||
  exit 1
step test-gpu 240 "$bin/test-gpu" --test-threads=1 --nocapture
step test-plan 60 "$bin/test-plan_levels" --test-threads=2
ck=/tmp/kiln-gpu-ck
step train 180 "$kiln" train --device cuda --epochs 1 --checkpoint-dir "$ck"
step train-gpus 180 "$kiln" train --device cuda --set train.data_parallel=gpus --epochs 1 \
  --checkpoint-dir /tmp/kiln-gpu-ck-dp
step train-bf16 180 "$kiln" train --device cuda --precision bf16 --epochs 1
step optimize-f16 120 "$kiln" optimize --model mlp --checkpoint "$ck" --passes strip,fold,f16 \
  --device cuda --out /tmp/kiln-gpu-opt
# The ONNX import on the GPU: each model's outputs against ONNX Runtime (on the CPU here).
for m in resnet mobilenet_v2 efficientnet vit seghead; do
  step "onnx $m" 90 "$kiln" bench --onnx "models/onnx/$m.onnx" --device cuda --batch 8 \
    --steps 10 --threads 8 --json
done
[ "${1:-}" = quick ] && exit 0

# Benchmarks: one JSON line per case in bench.jsonl.
bench="$out/bench.jsonl"
torch=(python3 .gpu/peers/torch_bench.py --device cuda --threads 8 --json)
for w in W2 W5 W1 W4; do
  step "kiln $w precision" 240 "$kiln" bench --workload "$w" --mode precision --json \
    --threads 8 >>"$bench"
  step "torch $w f32" 120 "${torch[@]}" --workload "$w" --mode train >>"$bench"
  step "torch $w bf16" 120 "${torch[@]}" --workload "$w" --mode train --amp bf16 >>"$bench"
done
# The A/Bs in f32 only (one child case each): without fusion, and with the fewest autotune
# candidates.
for w in W2 W5; do
  step "kiln-eager $w f32" 180 "$bin/kiln-eager" bench --workload "$w" --mode precision \
    --case f32 --threads 8 | sed 's/"case":"/"case":"eager-/' >>"$bench"
  step "kiln $w f32 autotune-minimal" 180 env CUBECL_AUTOTUNE_LEVEL=minimal "$kiln" bench \
    --workload "$w" --mode precision --case f32 --threads 8 |
    sed 's/"case":"/"case":"tune-minimal-/' >>"$bench"
done
for b in 1 64; do
  for c in gpu-f32 gpu-f16 gpu-bf16; do
    step "kiln W3 $c b$b" 60 "$kiln" bench --workload W3 --mode infer --case "$c" --batch "$b" \
      --threads 8 >>"$bench"
  done
done
for b in 1 64; do
  step "torch W3 infer b$b" 60 "${torch[@]}" --workload W3 --mode infer --batch "$b" >>"$bench"
done
step "torch W3 infer b64 bf16" 60 "${torch[@]}" --workload W3 --mode infer --batch 64 \
  --amp bf16 >>"$bench"
step "tune auto" 240 "$kiln" tune auto --device cuda --model cnn --steps 5 \
  --out "$out/tuned.toml"
cat "$bench"
