"""ONNX Runtime timing of any ONNX file, the peer `kiln bench --onnx` runs beside Kiln.

usage: python ort_file_bench.py MODEL.onnx --shapes '{"input": [8, 3, 32, 32]}'
                                [--threads 2] [--steps 50] [--int8] [--io DIR]

Same protocol as `kiln bench` and ../shared/peers: 5 warm-up runs, 3 repeats of `steps`
runs, median ms per run. Float inputs are standard normal (seed 1), integer inputs are ones
(a valid token id and a full attention mask). `--int8` times onnxruntime's dynamic int8
quantization of the file (`quantize_dynamic`, QInt8 weights). With `--io DIR` the inputs are
read from DIR/in{i}.bin (raw little-endian, in the model's input order: float32 or int64) and
the outputs of one run written to DIR/out{i}.bin (float32), so the caller can compare its own
outputs on the very same inputs. Prints one JSON object.
Needs only numpy and onnxruntime (no PyTorch).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import onnxruntime as ort


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--shapes", required=True, help="JSON object: input name -> shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--int8", action="store_true")
    p.add_argument("--io", help="directory of in{i}.bin inputs; out{i}.bin outputs are written")
    a = p.parse_args()
    path = a.model
    if a.int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        tmp = tempfile.mkdtemp()
        qpath = os.path.join(tmp, "model.int8.onnx")
        quantize_dynamic(path, qpath, weight_type=QuantType.QInt8)
        path = qpath
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    shapes = json.loads(a.shapes)
    rng = np.random.default_rng(1)
    feeds = {}
    for k, i in enumerate(sess.get_inputs()):
        shape = shapes[i.name]
        dtype = np.int64 if "int" in i.type else np.float32
        if a.io:
            feeds[i.name] = np.fromfile(os.path.join(a.io, f"in{k}.bin"), dtype="<" + np.dtype(dtype).str[1:]).reshape(shape)
        elif dtype == np.int64:
            feeds[i.name] = np.ones(shape, dtype=np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape, dtype=np.float32)
    if a.io:
        for k, out in enumerate(sess.run(None, feeds)):
            np.asarray(out, dtype="<f4").tofile(os.path.join(a.io, f"out{k}.bin"))
    for _ in range(5):
        sess.run(None, feeds)
    repeats = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(a.steps):
            sess.run(None, feeds)
        repeats.append((time.perf_counter() - t) / a.steps)
    ms = statistics.median(repeats) * 1e3
    print(json.dumps({"peer": "onnxruntime", "version": ort.__version__, "int8": a.int8,
                      "threads": a.threads, "ms_per_run": round(ms, 4)}))


if __name__ == "__main__":
    main()
