#!/usr/bin/env python3
"""Generates an ImageNet-shaped image folder: photographic-like JPEG files, nothing downloaded.

    python tools/make_image_set.py OUT --count 5000 --classes 10 [--val 500] [--seed 0]

Writes OUT/train/<class>/*.jpg (and OUT/val/<class>/*.jpg with --val), the layout of
torchvision's ImageFolder and `kiln train --data imagefolder:OUT`. Each image is a scene a
camera could have taken, as far as a decoder can tell: a sky-to-ground gradient, texture from
several octaves of smooth noise (the spectrum falls off as natural images' does), a few
soft-edged objects whose shape, colour and count depend on the class (so a model can learn
the classes), a slight blur and sensor noise. Sizes follow ImageNet's: most 500x375 or
375x500, the rest between 300 and 640 a side. Encoded by Pillow's libjpeg at quality 90 with
4:2:0 chroma subsampling (as most camera and ImageNet files); --progressive-share of them
progressive, --gray-share grayscale, --exif-share with an EXIF orientation tag (the pixels
stored turned, the tag turning them back), as real collections have.

Needs numpy and Pillow (the peers' venv has both).
"""
import argparse
import io
import os
import sys

import numpy as np
from PIL import Image, ImageFilter


def smooth_noise(rng, h, w, octaves=7, decay=0.8):
    """Sum of upsampled random grids from 1/64 of the size down to single pixels, amplitude
    falling by `decay` per octave (a 1/f-like spectrum: photographs keep detail at every
    scale, which is what makes their JPEG files as large as they are)."""
    out = np.zeros((h, w), np.float32)
    amp, total = 1.0, 0.0
    for o in range(octaves):
        gh, gw = max(2, h >> (6 - o)), max(2, w >> (6 - o))
        grid = rng.random((gh, gw), dtype=np.float32)
        up = Image.fromarray((grid * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
        out += amp * (np.asarray(up, np.float32) / 255.0 - 0.5)
        total += amp
        amp *= decay
    return out / total


def scene(rng, label, classes, h, w):
    hue = label / classes
    base = np.array([0.5 + 0.4 * np.cos(2 * np.pi * (hue + k / 3)) for k in range(3)], np.float32)
    sky = np.array([0.55, 0.7, 0.9], np.float32)
    t = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    img = sky * (1 - t) + base * t
    tex = smooth_noise(rng, h, w)[:, :, None]
    img = img + 0.35 * tex * (0.5 + base)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    sides = 3 + label % 5
    for _ in range(1 + label % 4 + rng.integers(0, 3)):
        cy, cx = rng.uniform(0.2, 0.8) * h, rng.uniform(0.15, 0.85) * w
        r = rng.uniform(0.08, 0.25) * min(h, w)
        ang = np.arctan2(yy - cy, xx - cx)
        # A rounded polygon with `sides` lobes: the class's shape.
        radius = r * (1 + 0.25 * np.cos(sides * ang + rng.uniform(0, 6.28)))
        d = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        mask = np.clip((radius - d) / 3.0, 0, 1)[:, :, None]
        colour = np.clip(base[::-1] + rng.normal(0, 0.1, 3), 0, 1).astype(np.float32)
        shade = colour * (0.8 + 0.4 * smooth_noise(rng, h, w)[:, :, None])
        img = img * (1 - mask) + shade * mask
    img = np.clip(img, 0, 1)
    pil = Image.fromarray((img * 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.5))
    arr = np.asarray(pil, np.float32) + rng.normal(0, 5.0, (h, w, 3)).astype(np.float32)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def size(rng):
    u = rng.random()
    if u < 0.55:
        return 375, 500
    if u < 0.8:
        return 500, 375
    return int(rng.integers(300, 641)), int(rng.integers(300, 641))


def write(path, img, rng, args):
    u = rng.random()
    kwargs = dict(quality=args.quality, subsampling="4:2:0")
    if u < args.gray_share:
        img = img.convert("L")
    elif u < args.gray_share + args.exif_share:
        # Store the pixels turned a quarter clockwise with tag 8 ("rotate 270 to view"),
        # so a viewer that honours the tag shows the scene upright.
        img = img.transpose(Image.Transpose.ROTATE_90)
        exif = Image.Exif()
        exif[0x0112] = 8
        kwargs["exif"] = exif.tobytes()
    if rng.random() < args.progressive_share:
        kwargs["progressive"] = True
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kwargs)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return len(buf.getvalue())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--count", type=int, default=5000, help="training images")
    p.add_argument("--val", type=int, default=0, help="validation images (OUT/val)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progressive-share", type=float, default=0.1)
    p.add_argument("--gray-share", type=float, default=0.02)
    p.add_argument("--exif-share", type=float, default=0.02)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    total = 0
    for split, n in (("train", args.count), ("val", args.val)):
        for i in range(n):
            label = i % args.classes
            d = os.path.join(args.out, split, f"class_{label:02d}")
            os.makedirs(d, exist_ok=True)
            h, w = size(rng)
            total += write(os.path.join(d, f"img_{i:06d}.jpg"), scene(rng, label, args.classes, h, w), rng, args)
            if (i + 1) % 500 == 0:
                print(f"{split}: {i + 1}/{n}", file=sys.stderr)
    print(f"wrote {args.count + args.val} images, {total / 2**20:.1f} MiB, to {args.out}")


if __name__ == "__main__":
    main()
