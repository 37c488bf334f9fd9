#!/usr/bin/env bash
# Data parallelism side by side: Kiln over MPI (`kiln train --processes 2`, 1 thread per rank)
# vs one Kiln process with both threads, and PyTorch DDP (gloo) the same two ways, on W1, W2
# and W4 with the same global batch. Needs the mpi build (`cargo build --release -p kiln-cli
# --features mpi`) and the PyTorch peer venv (PEERS_VENV, ../shared/peers/setup.sh).
#
# usage: bench/data_parallel.sh [rounds]
# Protocol: 5 warm-up steps, then 3 groups of N steps, the median group's samples/s (Kiln from
# its step events, on the bundled MNIST subset through its loader; PyTorch from
# torch_ddp.py on in-memory tensors of the same shape).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
kiln="${KILN_BIN:-target/release/kiln}"
py="${PEERS_VENV:-$HOME/.cache/kiln-peers}/bin/python"
export KILN_PEERS_DIR="${KILN_PEERS_DIR:-../shared/peers}"
steps=8

rate() { python3 bench/data_parallel_rate.py "$@"; }

for round in $(seq "$rounds"); do
  for case in "mlp W1 256" "cnn W2 128" "transformer W4 64"; do
    set -- $case
    model=$1 w=$2 g=$3 h=$(( $3 / 2 ))
    common=(train --model "$model" --level basic --workers 0 --epochs 1 --max-steps $((5 + 3 * steps)) --json)
    "$kiln" "${common[@]}" --batch-size "$g" --threads 2 2>/dev/null \
      | rate kiln "round $round $w kiln 1 proc x 2 threads b$g"
    "$kiln" "${common[@]}" --batch-size "$h" --processes 2 2>/dev/null \
      | rate kiln "round $round $w kiln 2 procs x 1 thread b${h}x2"
    "$py" bench/peers/torch_ddp.py --workload "$w" --world 1 --batch "$g" --threads 2 --steps "$steps" \
      | rate torch "round $round $w torch 1 proc x 2 threads b$g"
    "$py" bench/peers/torch_ddp.py --workload "$w" --world 2 --batch "$h" --threads 1 --steps "$steps" \
      | rate torch "round $round $w torch DDP 2 procs x 1 thread b${h}x2"
  done
done
