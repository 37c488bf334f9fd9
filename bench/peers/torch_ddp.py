"""PyTorch DistributedDataParallel peer for Kiln's data parallelism (docs/distributed.md).

Trains a standard workload (W1, W2, W4 from ../shared/peers/workloads.py) with `--world`
processes on this machine (gloo, the CPU backend of torch.distributed), `--batch` samples per
rank, `--threads` threads per rank, Adam, and prints rank 0's timing as JSON: the same
protocol as torch_bench.py (5 warm-up steps, 3 repeats of N steps, median).

usage: python torch_ddp.py --workload W2 --world 2 --batch 64 --threads 1 [--steps 20]
       (KILN_PEERS_DIR points at the shared peers, default ../shared/peers)
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.environ.get("KILN_PEERS_DIR", "../shared/peers"))
from workloads import WORKLOADS, measure  # noqa: E402


def rank_main(rank, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ctor, _, shape = WORKLOADS[a.workload]
    model = ctor()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if a.world > 1 else model
    g = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randn((a.batch, *shape), generator=g) for _ in range(8)]
    ys = [torch.randint(0, 10, (a.batch,), generator=g) for _ in range(8)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    i = [0]

    def step():
        k = i[0] % 8
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(xs[k]), ys[k]).backward()
        opt.step()

    s, other = measure(step, a.steps)
    dist.barrier()
    if rank == 0:
        print(json.dumps({
            "peer": "pytorch-ddp", "version": torch.__version__, "backend": "gloo",
            "workload": a.workload, "world": a.world, "batch_per_rank": a.batch,
            "threads_per_rank": a.threads, "ms_per_step": round(s * 1e3, 3),
            "samples_per_s": round(a.batch * a.world / s, 1), "other_load": other,
        }))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="W2", choices=["W1", "W2", "W4"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--port", type=int, default=29517)
    a = p.parse_args()
    mp.spawn(rank_main, args=(a, a.port), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
