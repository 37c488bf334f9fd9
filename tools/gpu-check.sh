#!/usr/bin/env bash
# Kiln's checks on a machine with an NVIDIA GPU, from what tools/gpu-pack.sh packed into
# .gpu/bin (xz): the plan on cuda, the GPU tests (Burn's device collective under data
# parallelism, the watermark on device memory), the main job and `kiln optimize --device
# cuda` with the f16 pass, the ONNX import on the GPU against ONNX Runtime, then the
# benchmarks: Kiln f32/bf16/f16 training on the GPU beside PyTorch (same shapes, f32 and
# bf16 autocast), the autotune A/B (CUBECL_AUTOTUNE_LEVEL), W3 inference and `kiln tune
# auto`. Every step has a time limit and writes to $OUT (default /tmp/kiln-gpu), so a slow
# step costs its limit, not the lease. A lease carries at most 64 MiB, so a call takes
# `kiln` with either the tests (`test-gpu`) or `kiln-eager`; what is missing is skipped.
#
# usage: [KILN_GPU_PACK=.gpu] tools/gpu-check.sh [lease|all|checks|bench|fusion]
#   lease: `all` within one budget (KILN_GPU_BUDGET_S, default 480 s: a 15-minute lease's
#   one call, with the machine's start and the transfers around it): each step's limit is
#   cut to what is left, and a step that would start with under 10 s left is skipped.
#   checks: the checks without the benchmarks; bench: the benchmarks without the checks;
#   fusion: only the fusion A/B (`kiln` against `kiln-eager`, built without Burn's fusion),
#   alternated, in f32 and bf16.
# Budget (run 37, H200): CubeCL compiles and autotunes kernels per new shape on first use
# (W2's first step 13 s, a `kiln train` epoch 91 s of process time for 26 s of training;
# `kiln bench --mode precision` for W2 163 s), then reuses its on-disk cache; `all` needs
# more than one 15-minute lease. The working tree travels too (15 MB, 11 of it
# models/onnx): move the models a call does not use out of the checkout for the call.
set -u
cd "$(dirname "$0")/.."
what="${1:-all}"
deadline=""
if [ "$what" = lease ]; then
  deadline=$((SECONDS + ${KILN_GPU_BUDGET_S:-480}))
  what=all
fi
pack="${KILN_GPU_PACK:-.gpu}"   # the folder gpu-pack.sh filled (carried to the GPU machine)
out="${OUT:-/tmp/kiln-gpu}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu-check-$what.log") 2>&1
bin=/tmp/kiln-gpu-bin
mkdir -p "$bin"
for f in "$pack"/bin/*.xz; do
  [ -e "$f" ] || continue
  name=$bin/$(basename "$f" .xz)
  [ -x "$name" ] || { xz -dc "$f" >"$name.part" && chmod +x "$name.part" && mv "$name.part" "$name"; }
done
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
export LD_LIBRARY_PATH="$PWD/$pack/lib:/usr/local/cuda/lib64:${extra}:${LD_LIBRARY_PATH:-}"
step() { # step NAME SECONDS CMD...: runs CMD with a limit, reports its status and time
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if [ -n "$deadline" ]; then
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 10 ]; then
      echo "=== $name: skipped, the lease budget is spent" >&2
      return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name (limit ${limit}s): $*" >&2
  timeout "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc in $((SECONDS - t0))s" >&2
  return $rc
}
have() { [ -x "$bin/$1" ]; }
kiln="$bin/kiln"
bench="$out/bench.jsonl"
torch=(python3 "$pack"/peers/torch_bench.py --device cuda --threads 8 --json)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
ldd "$kiln" | grep "not found"
# CubeCL's compiled kernels and autotune results (device.kernel_cache = auto, under the user
# cache directory): kept in the pack so the next lease starts warm, and copied to $OUT at
# the end so they come back from this one.
export XDG_CACHE_HOME="$PWD/$pack/cache"
mkdir -p "$XDG_CACHE_HOME"
bring_back_caches() {
  [ -d "$XDG_CACHE_HOME/kiln" ] && tar -C "$XDG_CACHE_HOME" -czf "$out/kernel-cache.tgz" kiln
}
trap bring_back_caches EXIT
# A GPU test that finds no GPU fails instead of passing by running nothing.
export KILN_REQUIRE_GPU=1
step plan 60 "$kiln" plan --device cuda --level advanced --set train.data_parallel=gpus ||
  exit 1
# Every GPU path in one command of the one binary: device vs CPU (matmul, inference), W1
# training in f32 and bf16, the step's device reads, the device memory reading.
step check-gpu 180 "$kiln" check gpu

if [ "$what" = fusion ]; then
  # Alternated, so drift on the machine hits both builds alike.
  for round in 1 2; do
    for w in W2 W5; do
      for p in f32 bf16; do
        step "fusion $w $p r$round" 120 "$kiln" bench --workload "$w" --mode precision \
          --case "$p" --threads 8 | sed "s/\"case\":\"/\"case\":\"fused-r$round-/" >>"$bench"
        step "eager $w $p r$round" 120 "$bin/kiln-eager" bench --workload "$w" \
          --mode precision --case "$p" --threads 8 |
          sed "s/\"case\":\"/\"case\":\"eager-r$round-/" >>"$bench"
      done
    done
  done
  cat "$bench"
  exit 0
fi

if [ "$what" != bench ]; then
have test-gpu && step test-gpu 240 "$bin/test-gpu" --test-threads=1 --nocapture  # KILN_REQUIRE_GPU=1
ck=/tmp/kiln-gpu-ck
step train 180 "$kiln" train --device cuda --epochs 1 --checkpoint-dir "$ck"
step train-gpus 180 "$kiln" train --device cuda --set train.data_parallel=gpus --epochs 1 \
  --checkpoint-dir /tmp/kiln-gpu-ck-dp
step train-bf16 180 "$kiln" train --device cuda --precision bf16 --epochs 1
step optimize-f16 120 "$kiln" optimize --model cnn --checkpoint "$ck" --passes strip,fold,f16 \
  --device cuda --out /tmp/kiln-gpu-opt
fi
onnx() { # the ONNX import on the GPU: outputs against ONNX Runtime (on the CPU there)
  for m in "$@"; do
    step "onnx $m" 90 "$kiln" bench --onnx "models/onnx/$m.onnx" --device cuda --batch 8 \
      --steps 10 --threads 8 --json
  done
}
if [ "$what" = checks ]; then
  onnx resnet mobilenet_v2 efficientnet vit seghead
  exit 0
fi

# Benchmarks, most wanted first (a call's time limit may cut the tail): one JSON line per
# case in bench.jsonl.
vs_torch() {
  for w in "$@"; do
    step "kiln $w precision" 240 "$kiln" bench --workload "$w" --mode precision --json \
      --threads 8 >>"$bench"
    step "torch $w f32" 120 "${torch[@]}" --workload "$w" --mode train >>"$bench"
    step "torch $w bf16" 120 "${torch[@]}" --workload "$w" --mode train --amp bf16 >>"$bench"
  done
}
vs_torch W2 W5
# The A/Bs in f32: without Burn's fusion (the cuda-eager build, where packed), and with the
# fewest autotune candidates, against CubeCL's default above.
for w in W2 W5; do
  have kiln-eager && step "kiln-eager $w f32" 180 "$bin/kiln-eager" bench --workload "$w" \
    --mode precision --case f32 --threads 8 | sed 's/"case":"/"case":"eager-/' >>"$bench"
  step "kiln $w f32 autotune-minimal" 180 env CUBECL_AUTOTUNE_LEVEL=minimal "$kiln" bench \
    --workload "$w" --mode precision --case f32 --threads 8 |
    sed 's/"case":"/"case":"tune-minimal-/' >>"$bench"
done
onnx resnet vit
vs_torch W1 W4
for b in 1 64; do
  for c in gpu-f32 gpu-f16 gpu-bf16; do
    step "kiln W3 $c b$b" 60 "$kiln" bench --workload W3 --mode infer --case "$c" --batch "$b" \
      --threads 8 >>"$bench"
  done
  step "torch W3 infer b$b" 60 "${torch[@]}" --workload W3 --mode infer --batch "$b" >>"$bench"
done
step "tune auto" 240 "$kiln" tune auto --device cuda --model cnn --steps 5 \
  --out "$out/tuned.toml"
cat "$bench"
