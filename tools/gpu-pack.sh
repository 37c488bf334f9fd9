#!/usr/bin/env bash
# Builds what tools/gpu-check.sh runs on a GPU machine and packs it into .gpu/ (git-ignored):
# the `kiln` binary with CUDA (Burn's fusion + autotune), the same without fusion
# (`cuda-eager`, the fusion A/B's baseline), the GPU test binaries, the shared libraries
# they link that a bare CUDA image may lack, and the PyTorch peer scripts. Binaries are
# stripped and xz-compressed: a GPU lease carries at most 64 MiB with the working tree, so
# one call takes `kiln` with either the GPU tests or `kiln-eager` (tools/gpu-check.sh runs
# what it finds).
#
# usage: tools/gpu-pack.sh     (after tools/cuda-offline-llvm.sh; KILN_CUDA_TARGET_DIR moves
#                               the target directory, default target/cuda). Cold on 2 cores:
#                               about 32 + 20 + 25 minutes for the three builds.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${KILN_CUDA_TARGET_DIR:-target/cuda}"
export CARGO_TARGET_DIR="$target"
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib .gpu/peers
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude

# The eager build first: the fused one is built last, so target/cuda/release/kiln is it.
cargo build --release --locked -p kiln-cli --features cuda-eager
cp "$target/release/kiln" .gpu/bin/kiln-eager
cargo build --release --locked -p kiln-cli --features cuda
cp "$target/release/kiln" .gpu/bin/kiln
# The tests recompile the CubeCL stack once (dev-dependencies change feature unification):
# about 25 more minutes cold on 2 cores. Compile errors arrive as JSON: `cargo test` exits
# non-zero and the pipeline with it (pipefail).
cargo test --release --locked -p kiln --features cuda --no-run --test gpu \
  --message-format=json-render-diagnostics |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" ".gpu/bin/test-$name"; done

# Libraries the binaries link that a CUDA image built on another distribution may lack
# (LLVM's z3 or libxml2 where they are linked dynamically). Not the C/C++ runtimes: the
# image's own are newer, and an older libstdc++ first on the path would break its Python.
ldd .gpu/bin/kiln | awk '/=> \// {print $3}' |
  grep -E '/lib(z3|xml2|icu[a-z]*|ffi|edit|tinfo)[.]' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
cp ../shared/peers/*.py .gpu/peers/ 2>/dev/null || true
strip .gpu/bin/*
# -9e: about 29 MB per binary (162 MB stripped, most of it CubeCL's static LLVM).
xz -T0 -9e .gpu/bin/*
du -sh .gpu .gpu/bin/* .gpu/lib
