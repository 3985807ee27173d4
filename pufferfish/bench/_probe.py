"""Worker side of :func:`pufferfish.bench.probe.run_probe`.

Run as a plain script (``python _probe.py``) rather than ``-m`` so the worker only
imports torch, not the whole pufferfish package: startup time counts against the
test budget, and the probe must work even while other modules are mid-edit.

Each rank fills a float32 tensor with ``rank + 1``, all-reduces it (sum) and checks
every element equals ``n(n+1)/2``; then it times ``--small-iters`` all-reduces of one float, whose
median is the link's latency as a collective sees it (two ranks: one round trip, as a ring
all-reduce is a reduce-scatter step and an all-gather step); it prints one JSON line with both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nbytes", type=int, default=25_000_000)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--small-iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the machine is shared; summing is not the bottleneck

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print(json.dumps(measure(args.nbytes, args.iters, args.small_iters)), flush=True)
    dist.destroy_process_group()
    return 0


def measure(nbytes: int, iters: int = 1, small_iters: int = 10,
            device: torch.device | None = None) -> dict:
    """This rank's report of the module docstring's probe, in the process group already set up
    (also the in-process probe of ``pufferfish bench`` under torchrun: bench/launched.py, where
    ``device`` is the rank's GPU under NCCL: each all-reduce is then waited for on the GPU)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = max(1, nbytes // 4)
    device = device or torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Warm-up: establishes all pair connections so the timed part is pure transfer.
    dist.all_reduce(torch.ones(1024, device=device))
    sync()
    dist.barrier()

    correct = True
    expected = world * (world + 1) / 2
    elapsed = 0.0
    for _ in range(iters):
        x = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync()
        elapsed += time.perf_counter() - t0
        correct = correct and bool(torch.all(x == expected).item())
    small: list[float] = []
    for _ in range(max(1, small_iters)):
        one = torch.full((1,), float(rank + 1), device=device)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(one)
        sync()
        small.append(time.perf_counter() - t0)
        correct = correct and float(one.item()) == expected
    dist.barrier()
    return {"rank": rank, "world": world, "nbytes": numel * 4, "seconds": elapsed,
            "small_seconds": statistics.median(small), "correct": correct}


if __name__ == "__main__":
    code = main()
    # No interpreter shutdown after a gloo group (as pufferfish.distributed.env.exit_process,
    # without importing the package): docs/reliability.md, "No abort at exit".
    sys.stdout.flush()
    os._exit(code)
