#!/usr/bin/env python3
"""PyTorch twins of Kiln's user-shaped benchmark models (`kiln bench --workload U1|U2`,
crates/kiln-cli/src/user_shaped.rs): same layers, shapes, batch, Adam 1e-3 and cross-entropy,
timed with the peers' protocol (5 warm-up steps, 3 repeats of N steps, median).

U1: MobileNet-style depthwise-separable CNN on 3x32x32 (eager NCHW, and with
    --channels-last the layout PyTorch users switch to for such networks).
U2: pre-LN transformer encoder over 64 tokens of 32 features (d 128, 4 heads, GELU FFN 512,
    4 blocks, final LayerNorm, mean over tokens); attention written out (matmul, softmax,
    matmul) or, with --sdpa, through F.scaled_dot_product_attention as current PyTorch code
    writes it (the faster of the two on a given CPU is the peer to beat).

usage: python torch_user_models.py --workload U1 [--batch 64] [--threads 2] [--steps 5]
       [--channels-last] [--sdpa] [--json]
Needs ../shared/peers/workloads.py (its `measure`) on the path: run from there or set
KILN_PEERS_DIR.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.environ.get("KILN_PEERS_DIR", os.path.join(os.path.dirname(__file__), "../../../shared/peers")))
from workloads import measure  # noqa: E402

U1_BLOCKS = [(32, 64, 3, 1), (64, 128, 3, 2), (128, 128, 3, 1), (128, 256, 3, 2), (256, 256, 5, 1), (256, 256, 3, 1)]


def conv_bn_relu(cin, cout, k, s, groups):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class MobileNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, 32, 3, 1, 1)
        self.blocks = nn.Sequential(*[
            nn.Sequential(conv_bn_relu(cin, cin, k, s, cin), conv_bn_relu(cin, cout, 1, 1, 1))
            for cin, cout, k, s in U1_BLOCKS])
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


SDPA = False


class PreLnBlock(nn.Module):
    def __init__(self, d=128, heads=4):
        super().__init__()
        self.heads = heads
        self.norm_attn, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm_ff, self.ff_in, self.ff_out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        dk = d // self.heads
        qkv = self.qkv(self.norm_attn(x)).reshape(b, t, 3, self.heads, dk).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if SDPA:
            ctx = F.scaled_dot_product_attention(q, k, v)
        else:
            ctx = torch.softmax(q @ k.transpose(-2, -1) / dk ** 0.5, dim=-1) @ v
        x = x + self.proj(ctx.transpose(1, 2).reshape(b, t, d))
        return x + self.ff_out(F.gelu(self.ff_in(self.norm_ff(x))))


class PreLnEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 128)
        self.pos = nn.Parameter(torch.zeros(1, 64, 128))
        self.blocks = nn.Sequential(*[PreLnBlock() for _ in range(4)])
        self.norm, self.head = nn.LayerNorm(128), nn.Linear(128, 10)

    def forward(self, x):
        h = self.blocks(self.embed(x.reshape(x.shape[0], 64, 32)) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


WORKLOADS = {"U1": (MobileNetish, 64, (3, 32, 32), 5), "U2": (PreLnEncoder, 64, (1, 64, 32), 10)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="U1", choices=sorted(WORKLOADS))
    p.add_argument("--batch", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--sdpa", action="store_true", help="U2: F.scaled_dot_product_attention")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    global SDPA
    SDPA = a.sdpa
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ctor, batch, shape, steps = WORKLOADS[a.workload]
    batch, steps = a.batch or batch, a.steps or steps
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    model = ctor().to(memory_format=fmt) if a.channels_last else ctor()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn((batch, *shape), generator=g) for _ in range(8)]
    if a.channels_last:
        xs = [x.contiguous(memory_format=fmt) for x in xs]
    ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(8)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    i = [0]

    def step():
        k = i[0] % 8
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[k]), ys[k]).backward()
        opt.step()

    s, other = measure(step, steps)
    peer = "pytorch-channels-last" if a.channels_last else "pytorch-sdpa" if a.sdpa else "pytorch"
    out = {"peer": peer, "version": torch.__version__,
           "workload": a.workload, "mode": "train", "batch": batch, "threads": a.threads,
           "ms_per_step": round(s * 1e3, 3), "samples_per_s": round(batch / s, 1), "other_load": other}
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
