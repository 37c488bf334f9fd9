#!/usr/bin/env python3
"""Exports the per-frame models that `kiln bench --mode stream --video` is measured with, as a
user would export them from PyTorch: torchvision's LR-ASPP MobileNetV3-Large semantic
segmentation model with dynamic batch, height and width, opset 17, the default exporter.

No weights can be downloaded here, and a randomly initialized segmenter paints one class over
the whole frame, which would make every technique "agree" with it. So the model is first
trained for 300 steps (CPU, about two minutes) on frames like `kiln data make-video`'s:
textured backgrounds with sensor noise and bright rectangles, two classes (background,
object); its masks then follow the objects, and a technique that reuses a stale mask shows it
in the mean IoU.

    python tools/export_video_models.py OUT_DIR

Writes OUT_DIR/lraspp_mobilenet_v3.onnx (~13 MB, so it is built here, not committed) and a
reference output for a 1×3×288×512 input (OUT_DIR/lraspp_mobilenet_v3.ref.npz).
"""
import os
import sys

import numpy as np
import torch
import torchvision


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def scenes(batch: int, h: int, w: int, gen: torch.Generator):
    """Frames like the test videos': a sinusoidal grey texture, noise, bright rectangles."""
    ys = torch.arange(h).view(1, h, 1).float()
    xs = torch.arange(w).view(1, 1, w).float()
    fx = 12 + 24 * torch.rand(batch, 1, 1, generator=gen)
    fy = 9 + 18 * torch.rand(batch, 1, 1, generator=gen)
    ph = 6.28 * torch.rand(batch, 1, 1, generator=gen)
    base = 0.27 + 0.16 * torch.rand(batch, 1, 1, generator=gen)
    luma = base + 0.14 * (torch.sin(xs / fx + ph) * torch.cos(ys / fy) + 0.5 * torch.sin((xs + ys) / 7))
    tint = 0.9 + 0.2 * torch.rand(batch, 3, 1, 1, generator=gen)
    img = luma.unsqueeze(1) * tint
    mask = torch.zeros(batch, h, w, dtype=torch.long)
    for b in range(batch):
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            ow = int(torch.randint(w // 16, w // 4, (1,), generator=gen))
            oh = int(torch.randint(h // 16, h // 3, (1,), generator=gen))
            x0 = int(torch.randint(0, w - ow, (1,), generator=gen))
            y0 = int(torch.randint(0, h - oh, (1,), generator=gen))
            colour = torch.rand(3, generator=gen) * 0.5 + torch.tensor([0.5, 0.3, 0.3])
            img[b, :, y0:y0 + oh, x0:x0 + ow] = colour.view(3, 1, 1)
            mask[b, y0:y0 + oh, x0:x0 + ow] = 1
    img = img + 0.01 * torch.randn(img.shape, generator=gen)
    return (img.clamp(0, 1) - MEAN) / STD, mask


def train(model, steps: int = 300) -> None:
    gen = torch.Generator().manual_seed(3)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.train()
    for step in range(steps):
        x, y = scenes(8, 96, 160, gen)
        loss = torch.nn.functional.cross_entropy(model(x)["out"], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    # 300 steps leave BatchNorm's running averages behind the weights: recompute them as
    # plain means over fresh batches, or the exported (eval-mode) model predicts nothing.
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        for _ in range(20):
            model(scenes(8, 96, 160, gen)[0])
    model.eval()
    with torch.no_grad():
        x, y = scenes(16, 288, 512, gen)
        pred = model(x)["out"].argmax(1)
        inter = ((pred == 1) & (y == 1)).sum().item()
        union = ((pred == 1) | (y == 1)).sum().item()
        print(f"held-out object IoU {inter / max(union, 1):.3f}", flush=True)


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "video-models"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=2
    )
    train(model)
    model.eval()

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
