"""Worker of tests/test_diloco_fsdp.py under torchrun (gloo, 4 processes): ``python
diloco_fsdp_worker.py OUT``.

Two replicas of two processes (``replica_mesh(2)``): a small net sharded with FSDP2 over each
replica, DiLoCo over the replicate group. Each process trains on its own batches for a few inner
steps, then the outer step runs; before it, the replica's full weights (gathered) are compared
across replicas, after it against a plain, unsharded Nesterov SGD applied to the average of the
replicas' full weights. Writes what it found as JSON (rank 0).
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pufferfish.distributed import fsdp
from pufferfish.distributed.diloco import DiLoCoState
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.distributed.replicas import replica_mesh

warnings.simplefilter("ignore")
torch.set_num_threads(1)
LR, MU, INNER, ROUNDS = 0.7, 0.9, 3, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()  # units: blocks.0, blocks.3 (3 rows on 2 shards: uneven), the root
        self.blocks = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.ReLU(),
                                    nn.Linear(10, 3))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.scale


def digest(tensors: list[torch.Tensor]) -> int:
    h = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors))
    return int.from_bytes(h.digest()[:7], "little")


def same_on(group: dist.ProcessGroup | None, value: int) -> bool:
    """Whether ``value`` is the same on every process of ``group``."""
    lo, hi = torch.tensor([value]), torch.tensor([value])
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return lo.item() == hi.item()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = replica_mesh(2, "cpu")
    replicate = mesh.get_group("replicate")
    torch.manual_seed(0)
    model = Net()
    reference = Net()  # unsharded: the synchronized weights as plain DiLoCo computes them
    reference.load_state_dict(model.state_dict())
    outer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MU, nesterov=True)
    fsdp.shard(model, mesh=mesh["shard"])
    state = DiLoCoState(INNER, LR, MU, replicate, buffer_group=None).bind(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    found: dict = {"differ_before": [], "equal_after": [], "max_error": [], "buffers_equal": [],
                   "bytes_per_outer_step": [], "full_param_bytes":
                   sum(p.numel() * 4 for p in reference.parameters())}
    g = torch.Generator().manual_seed(1000 + rank)  # every process its own batches
    for _ in range(ROUNDS):
        for _ in range(INNER):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        full = [p.full_tensor().detach().clone() for p in model.parameters()]  # this replica's
        found["differ_before"].append(not same_on(None, digest(full)))
        buffers = [b.detach().clone() for b in model.buffers() if b.is_floating_point()]
        for t in full:  # the replicas' sum (each shard-rank of a replica holds the same)
            dist.all_reduce(t, group=replicate)
        for t in buffers:  # every process's own statistics
            dist.all_reduce(t)
        with torch.no_grad():
            for p, mean in zip(reference.parameters(), full):
                p.grad = p.detach() - mean / 2
        outer.step()
        before = state.stats.bytes_sent
        state.sync()
        found["bytes_per_outer_step"].append(state.stats.bytes_sent - before)
        after = [p.full_tensor().detach() for p in model.parameters()]
        found["equal_after"].append(same_on(None, digest(after)))
        found["max_error"].append(max((a - r).abs().max().item()
                                      for a, r in zip(after, reference.parameters())))
        mine = [b for b in model.buffers() if b.is_floating_point()]
        found["buffers_equal"].append(
            same_on(None, digest(mine)) and all(torch.allclose(b, m / 4, atol=1e-6)
                                                for b, m in zip(mine, buffers)))
    if rank == 0:
        out.write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    cleanup()  # no interpreter shutdown after a gloo group (docs/reliability.md)
    exit_process(0)
