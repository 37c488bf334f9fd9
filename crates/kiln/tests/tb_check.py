"""Reads a TensorBoard event file with TensorBoard's own loader and prints what it holds.

Usage: tb_check.py EVENTS_FILE
Prints one JSON object: {"version": ..., "scalars": [[step, tag, value], ...],
"texts": {tag: text}}. Used by crates/kiln/tests/observability.rs to check that the files Kiln
writes are the files TensorBoard reads.
"""

import json
import sys

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

out = {"version": None, "scalars": [], "texts": {}}
for event in EventFileLoader(sys.argv[1]).Load():
    if event.HasField("file_version"):
        out["version"] = event.file_version
    for value in event.summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            out["scalars"].append([event.step, value.tag, value.simple_value])
        elif kind == "tensor":
            # The loader migrates legacy scalars to tensors; text is a string tensor.
            array = tensor_util.make_ndarray(value.tensor)
            if value.metadata.plugin_data.plugin_name == "text":
                out["texts"][value.tag] = array.item().decode("utf-8")
            else:
                out["scalars"].append([event.step, value.tag, float(array.item())])
print(json.dumps(out))
