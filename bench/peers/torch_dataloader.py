#!/usr/bin/env python3
"""PyTorch DataLoader peer for `kiln bench --mode data`.

Reads the same memory-mapped .npy files Kiln reads (uint8 images [N,C,H,W], int64 labels [N])
and applies the same per-sample transform in the workers: x/255, normalize with (mean, std),
then either (crop-flip) a random crop of the original size from the image padded by `padding`
with edge replication and a horizontal flip with p = 0.5, or (affine) a random affine of
+-10 degrees, +-8% shift, scale 0.9-1.1 with bilinear sampling and edge replication. Batches of `batch` are collated by the default collate_fn.
Workers are persistent, prefetch_factor 2, as Kiln's loader. Timing protocol: one warm-up
epoch (worker start-up), then 3 repeats of `epochs` epochs, median samples/s.

Prints one JSON object per worker count.
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class MappedImages(Dataset):
    def __init__(self, images, labels, mean, std, padding, transform):
        self.images_path, self.labels_path = images, labels
        self.images = None
        self.labels = None
        self.mean, self.std, self.padding = mean, std, padding
        self.transform = transform
        self.n = np.load(labels, mmap_mode="r").shape[0]

    def _open(self):
        # Opened lazily in each worker, as a memory-mapped array (like Kiln's MmapArray).
        if self.images is None:
            self.images = np.load(self.images_path, mmap_mode="r")
            self.labels = np.load(self.labels_path, mmap_mode="r")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self._open()
        x = torch.from_numpy(np.array(self.images[i], dtype=np.float32))
        x = (x / 255.0 - self.mean) / self.std
        if self.transform == "affine":
            return self.affine(x), int(self.labels[i])
        p = self.padding
        if p:
            h, w = x.shape[-2:]
            padded = F.pad(x.unsqueeze(0), (p, p, p, p), mode="replicate").squeeze(0)
            dy, dx = np.random.randint(0, 2 * p + 1, size=2)
            x = padded[:, dy:dy + h, dx:dx + w]
        if np.random.rand() < 0.5:
            x = torch.flip(x, dims=[-1])
        return x, int(self.labels[i])

    @staticmethod
    def affine(x):
        # Kiln's RandomAffine(10 deg, 8% shift, scale 0.9-1.1): bilinear, edge-replicated, the
        # way torchvision's tensor RandomAffine samples (affine_grid + grid_sample).
        angle = np.deg2rad(np.random.uniform(-10, 10))
        tu, tv = np.random.uniform(-0.08, 0.08, size=2) * 2
        s = np.random.uniform(0.9, 1.1)
        c, sn = np.cos(angle), np.sin(angle)
        theta = torch.tensor([[c / s, sn / s, -(c * tu + sn * tv) / s],
                              [-sn / s, c / s, -(-sn * tu + c * tv) / s]],
                             dtype=torch.float32).unsqueeze(0)
        grid = F.affine_grid(theta, [1, *x.shape], align_corners=True)
        return F.grid_sample(x.unsqueeze(0), grid, mode="bilinear", padding_mode="border",
                             align_corners=True).squeeze(0)


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mean", type=float, default=0.1307)
    ap.add_argument("--std", type=float, default=0.3081)
    ap.add_argument("--padding", type=int, default=2)
    ap.add_argument("--transform", choices=["crop-flip", "affine"], default="crop-flip")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = MappedImages(args.images, args.labels, args.mean, args.std, args.padding,
                        args.transform)
    for workers in [int(w) for w in args.workers.split(",")]:
        extra = {}
        if workers > 0:
            extra = dict(persistent_workers=True, prefetch_factor=2, worker_init_fn=seed_worker)
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, num_workers=workers,
                            drop_last=False, **extra)

        def run(epochs):
            n = 0
            t = time.perf_counter()
            for _ in range(epochs):
                for x, y in loader:
                    n += x.shape[0]
            return n / (time.perf_counter() - t)

        run(1)  # warm-up: worker start-up, page cache
        rates = [run(args.epochs) for _ in range(3)]
        print(json.dumps({
            "peer": "pytorch", "torch": torch.__version__, "workers": workers,
            "transform": args.transform,
            "batch": args.batch, "threads": args.threads,
            "samples_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
        }), flush=True)
        del loader


if __name__ == "__main__":
    main()
