"""Peak memory of the switch under FSDP2 against a dense replica (DDP's switch), per process.

    torchrun --nproc-per-node 2 benchmarks/fsdp_switch_memory.py MODEL WIDTH sharded|dense

Each process builds the model, takes one training step (so that the optimizer has state), resets
its peak resident set size (``/proc/self/clear_refs``, Linux), switches with ``pf.Recipe``, and
reads the peak again: the switch's extra peak is ``VmHWM - VmRSS`` before it. ``sharded``: the
model sharded by :func:`pufferfish.distributed.fsdp.shard` (dense weights gathered one layer at a
time, factors sharded again unit by unit); ``dense``: unsharded (every process holds the whole
dense model, as under DDP). One case per process group, so that neither reuses the other's freed
memory. Rank 0 prints one JSON line, with the model's dense bytes and the largest layer's.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import pufferfish as pf
from pufferfish.distributed import fsdp
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.models import build_at_width


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(name: str, width: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "transformer":
        return (build_at_width(name, width, vocab_size=4000),
                torch.randint(0, 4000, (35, 8)))
    return (build_at_width(name, width, num_classes=10, in_channels=1, image_size=28),
            torch.randn(16, 1, 28, 28))


def case(name: str, width: float, sharded: bool) -> dict:
    model, x = build(name, width)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                  for m in model.modules())
    if sharded:
        fsdp.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    out = model(x)
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = status("VmRSS")
    pf.Recipe(warmup_epochs=0, preset="paper").on_epoch_start(0, model, opt)
    peak = status("VmHWM")
    after = sum(fsdp.local(p).numel() * p.element_size() for p in model.parameters())
    return {"model": name, "width": width, "sharded": sharded, "world": dist.get_world_size(),
            "dense_param_bytes": dense, "largest_layer_bytes": largest,
            "param_bytes_after_per_process": after, "rss_before_bytes": before,
            "switch_peak_rss_bytes": peak, "switch_peak_extra_bytes": peak - before}


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
    width = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    row = case(name, width, sys.argv[3] == "sharded" if len(sys.argv) > 3 else True)
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    cleanup()  # no interpreter shutdown after a gloo group (docs/reliability.md)
    exit_process(0)
