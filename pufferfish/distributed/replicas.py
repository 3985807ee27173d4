"""DiLoCo over FSDP2: the processes as a grid of replicas x shards (``--parallel fsdp --sync
diloco``), as OpenDiLoCo and INTELLECT-1 run it: FSDP2 inside a machine, DiLoCo across machines.

FSDP2 shards one model over the ``shard_size`` processes of a group (one machine: torchrun's
``LOCAL_WORLD_SIZE``, unless ``--shard-size`` says otherwise), and each group is one DiLoCo
replica: ``world / shard_size`` of them. The mesh has the dims ``("replicate", "shard")``;
:func:`pufferfish.distributed.fsdp.shard` shards over ``mesh["shard"]`` and
:class:`~pufferfish.distributed.diloco.DiLoCoState` averages each process's *local shards* over
``mesh["replicate"]``: shard-rank ``i`` of every replica with shard-rank ``i`` of the others, so
every replica ends an outer step with the same full weights.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .env import collective_device

__all__ = ["grid", "replica_mesh"]


def grid(world_size: int, shard_size: int) -> tuple[int, int]:
    """``(replicas, shard_size)`` for ``world_size`` processes; ``shard_size`` 0 means the
    processes of one machine (``LOCAL_WORLD_SIZE``). ValueError in one line when the world is not
    a multiple of the shard size, or holds a single replica (nothing for DiLoCo to average)."""
    size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    what = f"shard_size {shard_size}" if shard_size else \
        f"shard_size 0 (LOCAL_WORLD_SIZE {size}, the processes of one machine)"
    if size < 1 or world_size % size:
        raise ValueError(f"{what} is invalid with {world_size} processes: allowed a divisor of "
                         "the world size")
    if size == world_size:
        raise ValueError(f"{what} is invalid with sync 'diloco' on {world_size} processes (one "
                         "replica: nothing for DiLoCo to average): allowed a divisor of "
                         f"{world_size} below it (--shard-size), or --parallel ddp")
    return world_size // size, size


def replica_mesh(shard_size: int, device_type: str) -> DeviceMesh:
    """The 2-D mesh ``("replicate", "shard")`` of this process group (see :func:`grid`); a
    collective. Every machine must run as many processes when ``shard_size`` is 0."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    sizes = torch.tensor([local, -local], device=collective_device())
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN)  # before any refusal: every process learns it
    low, high = int(sizes[0]), -int(sizes[1])
    if not shard_size and low != high:
        raise ValueError(f"shard_size 0 is invalid when machines run different numbers of "
                         f"processes (LOCAL_WORLD_SIZE {low} to {high}): allowed the same number "
                         "on every machine, or --shard-size")
    replicas, size = grid(world, shard_size)
    # torchrun numbers a machine's processes consecutively: each row of the mesh is one machine
    return init_device_mesh(device_type, (replicas, size), mesh_dim_names=("replicate", "shard"))
