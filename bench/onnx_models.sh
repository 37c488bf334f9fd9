#!/usr/bin/env bash
# Kiln vs ONNX Runtime on every ONNX file in a directory: `kiln bench --onnx` per model
# (batch 1 and 8, same threads, same inputs), one JSON line per case and a markdown table.
#
#   bench/onnx_models.sh [DIR] [THREADS] [STEPS] [--int8]
#
# DIR defaults to models/onnx (the small test exports). For the published sizes:
#   $PEERS_VENV/bin/python tools/export_onnx_models.py --full /tmp/onnx-full
#   bench/onnx_models.sh /tmp/onnx-full 2 10
# KILN_PYTHON must name a Python with onnxruntime (default: python3).
set -euo pipefail
dir="${1:-models/onnx}"
threads="${2:-2}"
steps="${3:-20}"
int8=()
[ "${4:-}" = "--int8" ] && int8=(--int8)
kiln="${KILN:-target/release/kiln}"
[ -x "$kiln" ] || cargo build --release -p kiln-cli
out="$(mktemp)"
for model in "$dir"/*.onnx; do
  name="$(basename "$model" .onnx)"
  extra=()
  case "$name" in
    bert | bert.*) extra=(--input-dims input_ids=16 --input-dims attention_mask=16) ;;
    bert_base) extra=(--input-dims input_ids=128 --input-dims attention_mask=128) ;;
    # tools/onnx_corpus.py's transformers models: token ids with a dynamic length.
    hf_gpt2 | hf_bert | hf_t5_encoder | hf_llama) extra=(--input-dims input_ids=12) ;;
    # Its torch.nn models with a dynamic sequence axis (the lengths they were exported at).
    lstm | lstm.*) extra=(--input-dims tokens=12) ;;
    causal_lm | causal_lm.*) extra=(--input-dims ids=10) ;;
  esac
  echo "kiln bench --onnx $model ..." >&2
  "$kiln" bench --onnx "$model" --threads "$threads" --steps "$steps" --json "${extra[@]}" "${int8[@]}" | tee -a "$out" \
    || echo "kiln bench --onnx $model failed; the table goes on without it" >&2
done
echo
echo "| model | batch | Kiln ms | ORT ms | Kiln vs ORT | max rel. diff |"
echo "|---|---|---|---|---|---|"
python3 - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    ort = r.get("ort_ms")
    ratio = r.get("kiln_speedup_vs_ort")
    diff = r.get("max_rel_diff_vs_ort")
    name = r['model'] + (" int8" if r.get("int8") else "")
    print(f"| {name} | {r['batch']} | {r['kiln_ms']:.2f} | "
          f"{'-' if ort is None else f'{ort:.2f}'} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
          f"{'-' if diff is None else f'{diff:.1e}'} |")
PY
