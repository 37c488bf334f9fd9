#!/usr/bin/env bash
# Kiln vs the PyTorch and ONNX Runtime peers, back to back in one invocation, same shapes,
# same thread count, same timing protocol (5 warm-up, 3 repeats of N steps, median).
#
# usage: bench/compare.sh [--workload W1..W5|U1|U2|all] [--threads N] [--steps N]
# (U1, U2: the user-shaped models of crates/kiln-cli/src/user_shaped.rs, beside their PyTorch
# twins in bench/peers/torch_user_models.py)
# Peers are optional: without their venv this prints how to install them and still reports
# Kiln's numbers. Output: a ratio table (peer ms / Kiln ms: above 1.0 means Kiln is faster)
# and, with KILN_COMPARE_JSON=path, every raw result as JSON lines.
set -euo pipefail
cd "$(dirname "$0")/.."

workload=all threads=2 steps=""
while [ $# -gt 0 ]; do
  case "$1" in
    --workload) workload=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

peers_dir="${KILN_PEERS_DIR:-../shared/peers}"
venv="${PEERS_VENV:-$HOME/.cache/kiln-peers}"
py="$venv/bin/python"
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

cargo build --release -q -p kiln-cli
steps_arg=()
[ -n "$steps" ] && steps_arg=(--steps "$steps")

echo "== kiln bench --workload $workload --threads $threads" >&2
./target/release/kiln bench --workload "$workload" --threads "$threads" --json "${steps_arg[@]}" >>"$raw"

if [ -x "$py" ] && "$py" -c "import torch" 2>/dev/null; then
  if [ "$workload" = all ]; then wls="W1 W2 W3 W4 W5 U1 U2"; else wls=$workload; fi
  for w in $wls; do
    if [ "$w" = U1 ] || [ "$w" = U2 ]; then
      # The user-shaped models' PyTorch twins (bench/peers); U1 also channels-last, U2 also
      # through F.scaled_dot_product_attention.
      echo "== pytorch $w train" >&2
      KILN_PEERS_DIR="$peers_dir" "$py" bench/peers/torch_user_models.py --workload "$w" --threads "$threads" --json "${steps_arg[@]}" >>"$raw"
      if [ "$w" = U1 ]; then
        KILN_PEERS_DIR="$peers_dir" "$py" bench/peers/torch_user_models.py --workload "$w" --channels-last --threads "$threads" --json "${steps_arg[@]}" >>"$raw"
      else
        KILN_PEERS_DIR="$peers_dir" "$py" bench/peers/torch_user_models.py --workload "$w" --sdpa --threads "$threads" --json "${steps_arg[@]}" >>"$raw"
      fi
    elif [ "$w" = W3 ]; then
      for b in 1 64; do
        echo "== pytorch $w infer b$b" >&2
        (cd "$peers_dir" && "$py" torch_bench.py --workload "$w" --mode infer --batch "$b" --threads "$threads" --json "${steps_arg[@]}") >>"$raw"
        if "$py" -c "import onnxruntime" 2>/dev/null; then
          echo "== onnxruntime $w b$b" >&2
          (cd "$peers_dir" && "$py" ort_bench.py --workload "$w" --batch "$b" --threads "$threads" --json "${steps_arg[@]}") >>"$raw"
        fi
      done
    else
      echo "== pytorch $w train" >&2
      (cd "$peers_dir" && "$py" torch_bench.py --workload "$w" --mode train --threads "$threads" --json "${steps_arg[@]}") >>"$raw"
    fi
  done
else
  echo "peers not installed: run $peers_dir/setup.sh (creates $venv with PyTorch and ONNX Runtime);" >&2
  echo "reporting Kiln's numbers only" >&2
fi

[ -n "${KILN_COMPARE_JSON:-}" ] && cp "$raw" "$KILN_COMPARE_JSON"

python3 - "$raw" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
kiln = [r for r in rows if "case" in r]
peers = [r for r in rows if "peer" in r]
def best_kiln(w, mode, batch):
    c = [r for r in kiln if r["workload"] == w and r["mode"] == mode and r["batch"] == batch and r["case"] != "burn"]
    c = c or [r for r in kiln if r["workload"] == w and r["mode"] == mode and r["batch"] == batch]
    return min(c, key=lambda r: r["ms_per_step"]) if c else None
print(f"{'wl':<4} {'mode':<5} {'batch':>5} {'burn ms':>9} {'kiln ms':>9} {'kiln case':<14} {'peer':<12} {'peer ms':>9} {'peer/kiln':>9} {'load':>5}")
keys = sorted({(r["workload"], r["mode"], r["batch"]) for r in kiln})
for w, mode, batch in keys:
    burn = next((r for r in kiln if (r["workload"], r["mode"], r["batch"], r["case"]) == (w, mode, batch, "burn")), None)
    k = best_kiln(w, mode, batch)
    ps = [p for p in peers if p["workload"] == w and p["mode"] == mode and p["batch"] == batch] or [None]
    for p in ps:
        ratio = f"{p['ms_per_step'] / k['ms_per_step']:.2f}x" if p else "-"
        print(f"{w:<4} {mode:<5} {batch:>5} {burn['ms_per_step'] if burn else float('nan'):>9.2f} {k['ms_per_step']:>9.2f} {k['case']:<14} "
              f"{(p['peer'] if p else '-'):<12} {(p['ms_per_step'] if p else float('nan')):>9.2f} {ratio:>9} {(p['other_load'] if p else ''):>5}")
PY
