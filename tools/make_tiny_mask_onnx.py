"""Writes crates/kiln-serve/tests/data/tiny_mask.onnx: a two-class per-pixel segmenter with
dynamic batch, height and width (Conv 3x3 3->8 + ReLU, Conv 1x1 8->2), its class 1 marking
bright pixels. Its receptive field is 3x3, so a crop with a margin of a few pixels gives the
whole frame's result exactly: kiln-serve's tests use it to check that a per-frame stream
model's pasted regions equal the full model's mask.

usage: python tools/make_tiny_mask_onnx.py   (needs the `onnx` package and NumPy)
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(7)
w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.1).astype(np.float32)
w1[:, :, 1, 1] += 0.5  # each feature mostly the pixel itself
b1 = np.zeros(8, np.float32)
w2 = np.zeros((2, 8, 1, 1), np.float32)
w2[1, :, 0, 0] = 1.0  # class 1: the features' sum (bright pixels)
b2 = np.array([0.0, -2.0], np.float32)  # class 0 wins on dark pixels

x = helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["batch", 3, "height", "width"])
y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2, "height", "width"])
graph = helper.make_graph(
    [
        helper.make_node("Conv", ["frames", "w1", "b1"], ["h"], name="conv1", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["logits"], name="conv2", kernel_shape=[1, 1]),
    ],
    "tiny_mask",
    [x],
    [y],
    initializer=[numpy_helper.from_array(a, n) for a, n in [(w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2")]],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
onnx.checker.check_model(model)
out = os.path.join(os.path.dirname(__file__), "..", "crates/kiln-serve/tests/data/tiny_mask.onnx")
onnx.save(model, out)
print(f"wrote {out} ({os.path.getsize(out)} bytes)")
