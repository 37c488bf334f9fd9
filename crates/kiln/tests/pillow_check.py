#!/usr/bin/env python3
"""Writes image files with Pillow and Pillow's own decodes of them, for
tests/image_files.rs (decoded_pixels_and_resizes_match_pillow).

    python pillow_check.py DIR

For each case: DIR/<name> (the file), DIR/<name>.rgb (Pillow's decode, RGB, EXIF orientation
applied as ImageOps.exif_transpose does), and for some a crop+resize by Pillow's
resize(BILINEAR, box=...) of that decode. DIR/cases.json lists them with the tolerance each
comparison is held to: lossless formats exactly; JPEG within what two conforming decoders
differ by (IDCT rounding and chroma upsampling: libjpeg-turbo's and zune-jpeg's).
"""
import json
import os
import sys

import numpy as np
from PIL import Image, ImageOps


def photo(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([120 + 80 * np.sin(x / 23.0), 100 + 60 * np.cos(y / 17.0), 90 + 0.2 * (x + y)], -1)
    noise = rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    cases = []
    # JPEG tolerances (mean and max absolute difference, 8-bit levels): measured between
    # Pillow's libjpeg-turbo and zune-jpeg on these files, 4:2:0 (chroma upsampling differs
    # most): mean 0.40, max 5; 4:4:4, grayscale, CMYK: mean <= 0.02, max <= 3.
    jpeg_tol = (1.0, 12)

    def add(name, img, save, tol, resize=None):
        path = os.path.join(out, name)
        save(img, path)
        ref = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        ref_name = name + ".rgb"
        with open(os.path.join(out, ref_name), "wb") as f:
            f.write(ref.tobytes())
        case = {"file": name, "rgb": ref_name, "width": ref.width, "height": ref.height,
                "tol_mean": tol[0], "tol_max": tol[1]}
        if resize:
            box, (ow, oh) = resize
            r = ref.resize((ow, oh), Image.BILINEAR, box=box)
            rname = name + ".resized.rgb"
            with open(os.path.join(out, rname), "wb") as f:
                f.write(r.tobytes())
            case["resize"] = {"box": list(box), "width": ow, "height": oh, "rgb": rname}
        cases.append(case)

    base = photo(500, 375, 1)
    add("baseline.jpg", base, lambda i, p: i.save(p, quality=90, subsampling="4:2:0"), jpeg_tol,
        resize=((37.5, 20.25, 437.5, 330.0), (224, 224)))
    add("progressive.jpg", base, lambda i, p: i.save(p, quality=90, progressive=True), jpeg_tol)
    add("q95_444.jpg", photo(333, 250, 2), lambda i, p: i.save(p, quality=95, subsampling="4:4:4"), jpeg_tol)
    add("gray.jpg", base.convert("L"), lambda i, p: i.save(p, quality=90), jpeg_tol)
    add("cmyk.jpg", base.convert("CMYK"), lambda i, p: i.save(p, quality=95), jpeg_tol)

    def exif_rotated(img, path):
        exif = Image.Exif()
        exif[0x0112] = 6  # stored turned; rotate 90 clockwise to view
        img.transpose(Image.Transpose.ROTATE_90).save(path, quality=92, exif=exif.tobytes())

    add("exif6.jpg", photo(320, 240, 3), exif_rotated, jpeg_tol)
    rgba = photo(200, 150, 4).convert("RGBA")
    add("alpha.png", rgba, lambda i, p: i.save(p), (0.0, 0),
        resize=((10.0, 5.0, 190.0, 140.0), (64, 48)))
    add("gray16.png", photo(120, 90, 5).convert("L"), lambda i, p: i.save(p), (0.0, 0))
    add("lossless.webp", photo(160, 120, 6), lambda i, p: i.save(p, lossless=True), (0.0, 0))
    add("upscale.png", photo(40, 30, 7), lambda i, p: i.save(p), (0.0, 0),
        resize=((0.0, 0.0, 40.0, 30.0), (96, 72)))
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)


if __name__ == "__main__":
    main()
