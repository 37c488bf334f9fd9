#!/usr/bin/env python3
"""The usual Python deployment of a per-frame model on a video, the peer of
`kiln bench --mode stream --video`: PyAV decodes each frame and converts it to RGB at the
model's input size (libswscale, bilinear), NumPy normalizes it (ImageNet mean/std), ONNX
Runtime runs the model on every frame. Prints one JSON line.

    python bench/peers/video_peer.py VIDEO MODEL --width 512 --height 288 --threads 2
"""
import argparse
import json
import time

import av
import numpy as np
import onnxruntime as ort


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("video")
    ap.add_argument("model")
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--height", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decoder-threads", type=int, default=1)
    ap.add_argument("--frames", type=int, default=0)
    args = ap.parse_args()

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)

    container = av.open(args.video)
    stream = container.streams.video[0]
    stream.codec_context.thread_count = args.decoder_threads
    decode_s = convert_s = infer_s = 0.0
    latencies = []
    frames = 0
    start = time.perf_counter()
    it = container.decode(stream)
    while True:
        t0 = time.perf_counter()
        try:
            frame = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        rgb = frame.to_ndarray(width=args.width, height=args.height, format="rgb24",
                               interpolation="BILINEAR")
        x = ((rgb.transpose(2, 0, 1).astype(np.float32) / 255.0 - mean) / std)[None]
        t2 = time.perf_counter()
        out = sess.run(None, {name: x})[0]
        if out.ndim == 4:
            out.argmax(axis=1)
        t3 = time.perf_counter()
        decode_s += t1 - t0
        convert_s += t2 - t1
        infer_s += t3 - t2
        latencies.append((t3 - t1) * 1e3)
        frames += 1
        if args.frames and frames >= args.frames:
            break
    seconds = time.perf_counter() - start
    latencies.sort()
    pct = lambda q: latencies[round((len(latencies) - 1) * q)] if latencies else 0.0
    print(json.dumps({
        "frames": frames,
        "fps": frames / seconds,
        "decode_fps": frames / max(decode_s, 1e-9),
        "preprocess_fps": frames / max(convert_s, 1e-9),
        "inference_fps": frames / max(infer_s, 1e-9),
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "pyav": av.__version__,
        "onnxruntime": ort.__version__,
    }))


if __name__ == "__main__":
    main()
