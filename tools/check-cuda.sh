#!/usr/bin/env bash
# Type-checks and lints every crate and target with the `cuda` feature (no GPU needed; clippy
# with -D warnings, as CI runs it on the default build), so the cuda-gated code cannot rot
# unnoticed. Needs the LLVM prefix that tools/cuda-offline-llvm.sh
# sets up (once per machine). Uses its own target directory: the feature changes Burn's
# features, which would otherwise rebuild the default (flex) tree afterwards.
#
# usage: tools/check-cuda.sh            (KILN_CUDA_TARGET_DIR to move the target directory)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
if [ ! -f "$prefix/.tracel-llvm-installed" ]; then
  echo "no LLVM prefix at $prefix: run tools/cuda-offline-llvm.sh first" >&2
  exit 1
fi
CARGO_TARGET_DIR="${KILN_CUDA_TARGET_DIR:-target/cuda-check}" \
  cargo clippy --locked --workspace --all-targets --features kiln/cuda -- -D warnings
