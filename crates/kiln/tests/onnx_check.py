"""Runs an ONNX model in ONNX Runtime on a raw little-endian f32 input and writes the output.

Usage: onnx_check.py MODEL.onnx INPUT.bin D0,D1,D2,D3 OUTPUT.bin
Used by crates/kiln/tests/inference.rs to cross-check Kiln's exporter; 1 thread, CPU.
"""

import sys

import numpy as np
import onnxruntime as ort

model, input_path, dims, output_path = sys.argv[1:5]
shape = [int(d) for d in dims.split(",")]
x = np.fromfile(input_path, dtype="<f4").reshape(shape)
options = ort.SessionOptions()
options.intra_op_num_threads = 1
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
(y,) = session.run(None, {session.get_inputs()[0].name: x})
np.asarray(y, dtype="<f4").tofile(output_path)
