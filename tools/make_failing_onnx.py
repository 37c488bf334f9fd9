"""Writes crates/kiln-serve/tests/data/fails_above_batch_2.onnx: y = x + x[0:2], an ONNX
model whose forward works for batches of 1 and 2 (y = 2x) and fails at run time for 3 or
more (shapes [2, 4] and [batch, 4] do not broadcast). kiln-serve's tests use it as an
instance whose forward fails for some batches.

usage: python tools/make_failing_onnx.py   (needs the `onnx` package)
"""
import os

import onnx
from onnx import TensorProto, helper

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
consts = [
    helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
    helper.make_tensor("ends", TensorProto.INT64, [1], [2]),
    helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
]
graph = helper.make_graph(
    [
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["head"], name="first_two_rows"),
        helper.make_node("Add", ["x", "head"], ["y"], name="add_first_two_rows"),
    ],
    "fails_above_batch_2",
    [x],
    [y],
    initializer=consts,
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
onnx.checker.check_model(model)
out = os.path.join(os.path.dirname(__file__), "..", "crates/kiln-serve/tests/data/fails_above_batch_2.onnx")
onnx.save(model, out)
print(f"wrote {out} ({os.path.getsize(out)} bytes)")
