#!/usr/bin/env python3
"""Image-folder loader peers for `kiln bench --mode data --data imagefolder:DIR`.

The usual PyTorch vision input pipeline on the same files, workers and transforms as Kiln:
decode, RandomResizedCrop(224) (antialiased bilinear), RandomHorizontalFlip, Normalize
(ImageNet mean/std), batches of 64 collated in persistent workers (prefetch_factor 2,
pin_memory off: no GPU here). Variants:

  pil          torchvision.datasets.ImageFolder + torchvision.transforms.v2 on PIL images
               (PIL decodes with libjpeg-turbo; the ImageNet reference recipe)
  decode_jpeg  torchvision.io.decode_jpeg on the file's bytes, then v2 on uint8 tensors
  dali         NVIDIA DALI's CPU pipeline (fn.readers.file, fn.decoders.image_random_crop
               device="cpu", fn.resize, fn.crop_mirror_normalize), where nvidia-dali installs

Timing: one warm-up pass over `--warmup` images (worker start, page cache), then `--repeats`
passes of `--images` images each; median, min, max images/s. Peak RSS covers the process and
its workers (ru_maxrss of self + children). Prints one JSON object.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time


def rss_peak_bytes():
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (self_kb + child_kb) * 1024


def torch_loader(args):
    import torch
    from torch.utils.data import DataLoader, Subset
    import torchvision
    from torchvision.transforms import v2

    torch.set_num_threads(1 if args.workers > 0 else args.threads)
    tail = [
        v2.RandomResizedCrop(args.size, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ]
    if args.variant == "pil":
        # PIL image -> v2 on PIL for the crop (PIL's resize), then to a tensor.
        transform = v2.Compose([v2.RandomResizedCrop(args.size, antialias=True),
                                v2.RandomHorizontalFlip(), v2.PILToTensor()] + tail[2:])
        ds = torchvision.datasets.ImageFolder(args.root, transform=transform)
    else:
        from torchvision.io import ImageReadMode, decode_jpeg, read_file

        def load(path):
            return decode_jpeg(read_file(path), mode=ImageReadMode.RGB)

        ds = torchvision.datasets.ImageFolder(args.root, loader=load, transform=v2.Compose(tail))
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(ds), generator=g).tolist()
    n = min(len(ds), args.warmup + args.images * args.repeats)
    ds = Subset(ds, order[:n])
    loader = DataLoader(ds, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                        persistent_workers=args.workers > 0,
                        prefetch_factor=2 if args.workers > 0 else None, pin_memory=False)
    return loader


def time_torch(args):
    loader = torch_loader(args)
    it = iter(loader)
    rates = []
    seen = 0
    while seen < args.warmup:
        x, _ = next(it)
        seen += x.shape[0]
    for _ in range(args.repeats):
        t = time.perf_counter()
        got = 0
        while got < args.images:
            try:
                x, _ = next(it)
            except StopIteration:
                it = iter(loader)
                x, _ = next(it)
            got += x.shape[0]
        rates.append(got / (time.perf_counter() - t))
    return rates


def time_dali(args):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=args.batch, num_threads=max(1, args.workers or 1), device_id=None)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=args.root, random_shuffle=True, seed=0)
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=args.size, resize_y=args.size, antialias=True)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                          std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                          mirror=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    seen = 0
    while seen < args.warmup:
        seen += args.batch if p.run() else 0
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        got = 0
        while got < args.images:
            p.run()
            got += args.batch
        rates.append(got / (time.perf_counter() - t))
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--variant", choices=["pil", "decode_jpeg", "dali"], default="pil")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        rates = time_dali(args) if args.variant == "dali" else time_torch(args)
    except ImportError as e:
        print(json.dumps({"variant": args.variant, "workers": args.workers, "error": str(e)}))
        return
    import PIL
    system = {"pil": f"torch DataLoader + torchvision v2 + PIL {PIL.__version__}",
              "decode_jpeg": "torch DataLoader + torchvision.io.decode_jpeg + v2",
              "dali": "DALI CPU pipeline"}[args.variant]
    if args.variant == "pil" and "post" in PIL.__version__:
        system = system.replace("PIL", "pillow-simd")
    print(json.dumps({
        "variant": args.variant, "system": system, "workers": args.workers,
        "images_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
        "peak_rss_bytes": rss_peak_bytes(),
    }))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
