"""Builds the quantized ONNX corpus: float models quantized the ways users quantize them.

For each float model `models/onnx/NAME.onnx` (with its `NAME.ref.safetensors` inputs), ONNX
Runtime's quantizer writes three files:
  * `NAME.qdq.onnx`: `quantize_static`, QDQ format (QuantizeLinear / DequantizeLinear around
    each layer), int8 activations and per-channel int8 weights: ONNX Runtime's recommended
    form, and the one PyTorch's quantizers export;
  * `NAME.qop.onnx`: `quantize_static`, QOperator format (QLinearConv, QLinearMatMul), Conv
    and MatMul only (ONNX Runtime's QGemm and QLinearAdd are Microsoft-domain operators);
  * `NAME.dyn.onnx`: `quantize_dynamic` (DynamicQuantizeLinear, MatMulInteger, ConvInteger).
Calibration runs the reference inputs (batch 3, one sample at a time). Each model's
`NAME.FORMAT.ref.safetensors` holds the float model's inputs at batch 1 and 3 and ONNX
Runtime's outputs for the quantized model, as `export_onnx_models.py` names them: computed
operator by operator (graph optimizations off), which is ONNX's definition of the model.
ONNX Runtime's default session fuses Q/DQ chains into its own integer kernels, whose
requantization rounds differently; `quantized.json` records how far those outputs are from
the definition (`ort_fused_rel_error`), so a comparison with them can be judged.

    python tools/quantize_onnx_models.py models/onnx models/onnx/quantized
    python tools/quantize_onnx_models.py --only resnet,bert models/onnx /tmp/q

`crates/kiln/tests/onnx_quantized.rs` checks every model against its reference outputs.
"""

import argparse
import collections
import json
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_onnx_models import save_safetensors  # noqa: E402

# Float models of the zoo's ONNX set: every layer kind the quantizers treat differently
# (plain and grouped convolutions, depthwise, residual adds, attention's MatMuls, Gemm heads).
DEFAULT = ["lenet", "resnet", "mobilenet_v2", "shufflenet", "regnet", "efficientnet", "seghead", "bert", "vit"]


class Reader(CalibrationDataReader):
    def __init__(self, feeds):
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def run(path, feeds, optimized):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def definition_reference(path, feeds_by_batch):
    """ONNX Runtime's outputs operator by operator, and how far its fused session is off."""
    tensors, worst = {}, 0.0
    for batch, feeds in feeds_by_batch.items():
        for name, value in feeds.items():
            tensors[f"b{batch}.in.{name}"] = value
        plain, fused = run(path, feeds, False), run(path, feeds, True)
        for i, (a, b) in enumerate(zip(plain, fused)):
            tensors[f"b{batch}.out.{i}"] = np.asarray(a)
            scale = max(float(np.abs(a).max()), 1e-12)
            worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()) / scale)
    return tensors, worst


def feeds_of(ref):
    """The reference inputs by batch: {1: {name: array}, 3: {...}}."""
    out = collections.defaultdict(dict)
    for key, value in ref.items():
        batch, kind, name = key.split(".", 2)
        if kind == "in":
            out[int(batch[1:])][name] = value
    return out


def quantize(src, dst, fmt, feeds):
    if fmt == "dyn":
        quantize_dynamic(src, dst)
        return
    calibration = [{k: v[i:i + 1] for k, v in feeds[3].items()} for i in range(3)]
    if fmt == "qdq":
        quantize_static(src, dst, Reader(calibration), quant_format=QuantFormat.QDQ, per_channel=True)
    else:
        quantize_static(src, dst, Reader(calibration), quant_format=QuantFormat.QOperator, per_channel=True,
                        op_types_to_quantize=["Conv", "MatMul"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--only", default="")
    ap.add_argument("--formats", default="qdq,qop,dyn")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or DEFAULT
    listing = []
    for name in names:
        src = os.path.join(args.src, f"{name}.onnx")
        feeds = feeds_of(load_file(os.path.join(args.src, f"{name}.ref.safetensors")))
        for fmt in args.formats.split(","):
            entry = {"name": f"{name}.{fmt}", "source": name, "format": fmt}
            dst = os.path.join(args.out, f"{name}.{fmt}.onnx")
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    # The quantizer writes beside its output; a temp dir keeps `out` clean.
                    staged = os.path.join(tmp, "model.onnx")
                    quantize(src, staged, fmt, feeds)
                    os.replace(staged, dst)
                tensors, entry["ort_fused_rel_error"] = definition_reference(dst, {b: feeds[b] for b in (1, 3)})
                save_safetensors(os.path.join(args.out, f"{name}.{fmt}.ref.safetensors"), tensors)
                ops = collections.Counter(n.op_type for n in onnx.load(dst).graph.node)
                entry["ops"] = dict(sorted(ops.items()))
                entry["mb"] = round(os.path.getsize(dst) / 1e6, 3)
                print(f"{name}.{fmt}: {entry['mb']} MB")
            except Exception as e:  # noqa: BLE001 - listed: the quantizer's limits, not Kiln's
                entry["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(f"{name}.{fmt}: skipped ({entry['skipped']})", file=sys.stderr)
                if os.path.exists(dst):
                    os.remove(dst)
            listing.append(entry)
    index = os.path.join(args.out, "quantized.json")
    with open(index + ".tmp", "w") as f:
        json.dump(listing, f, indent=1)
    os.replace(index + ".tmp", index)


if __name__ == "__main__":
    main()
