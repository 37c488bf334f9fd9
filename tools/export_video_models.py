#!/usr/bin/env python3
"""Exports the per-frame models that `kiln bench --mode stream --video` is measured with, as a
user would export them from PyTorch: torchvision's LR-ASPP MobileNetV3-Large semantic
segmentation model (21 classes, the Pascal VOC head; random init from a fixed seed, no
download) with dynamic batch, height and width, opset 17, the default exporter.

    python tools/export_video_models.py OUT_DIR

Writes OUT_DIR/lraspp_mobilenet_v3.onnx (~13 MB, so it is built here, not committed) and a
reference output for a 1×3×288×512 input (OUT_DIR/lraspp_mobilenet_v3.ref.npz).
"""
import os
import sys

import numpy as np
import torch
import torchvision


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "video-models"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=21
    ).eval()

    class Logits(torch.nn.Module):
        """The model's `out` head only: torchvision returns a dict."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)["out"]

    wrapped = Logits(model).eval()
    x = torch.randn(1, 3, 288, 512, generator=torch.Generator().manual_seed(1))
    path = os.path.join(out, "lraspp_mobilenet_v3.onnx")
    torch.onnx.export(
        wrapped,
        (x,),
        path,
        input_names=["image"],
        output_names=["logits"],
        dynamic_axes={"image": {0: "batch", 2: "height", 3: "width"},
                      "logits": {0: "batch", 2: "height", 3: "width"}},
        opset_version=17,
        dynamo=False,
    )
    with torch.no_grad():
        ref = wrapped(x).numpy()
    np.savez(os.path.join(out, "lraspp_mobilenet_v3.ref.npz"), image=x.numpy(), logits=ref)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
