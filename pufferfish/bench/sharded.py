"""The FSDP2 methods of ``pufferfish bench`` (``fsdp``, ``pufferfish+fsdp``): one method's steps.

The counterpart of :func:`pufferfish.bench.step.measure` for sharded data parallel, with the same
minibatches, warm-up and record. Protocol:

- the model is built as for the other methods (``pufferfish+fsdp``: factorized at ¼ with the
  paper preset), in contiguous memory (FSDP2 shards contiguous tensors only, so no
  ``--channels-last``, as in ``pufferfish train --parallel fsdp``), then sharded with
  :func:`pufferfish.distributed.fsdp.shard`, the units that training uses; the optimizer is
  built after sharding, on the shards;
- ``compute_time``: median of ``--compute-steps`` of the same steps on an unsharded local copy of
  the model (copied before sharding, with its own optimizer): no communication at all. FSDP2 has
  no communication-free mode: its all-gathers happen even with gradient sync off;
- ``step_time``: median of ``--steps`` full FSDP2 steps, each started after a barrier; compute-only
  and full steps alternate, as in ``measure``. A full step is training's: the all-gathers, the
  reduce-scatters, and rank 0's buffers (BatchNorm statistics) broadcast before each forward;
- ``bytes_per_step``: the all-gather + reduce-scatter payload of :func:`fsdp.comm_bytes`
  (``all_gather_bytes_per_step``, ``reduce_scatter_bytes_per_step``), ``ring_bytes_per_step``
  its ring figure, ``collectives_per_step`` the all-gathers and reduce-scatters of one step;
- ``shard_param_bytes`` / ``shard_grad_bytes`` / ``shard_optimizer_bytes``: this process's
  sharded state after the timed steps. No DDP buckets (``bucket_mib`` None), no comm hook
  (``hook`` "fsdp2", no encode time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch.distributed as dist

from ..distributed import fsdp
from ..training.step import Replica
from .workload import build_model, make_optimizer, quartiles, timed, train_one_step

__all__ = ["HOOK_NAME", "measure_sharded"]

HOOK_NAME = "fsdp2"  # the records' "hook": FSDP2's own all-gathers and reduce-scatters


def measure_sharded(args: argparse.Namespace, method: str, factorized: bool,
                    minibatches: list[Any]) -> dict[str, Any]:
    """The protocol above for ``method`` (its model ``factorized`` or not) on this rank; its
    per-rank record."""
    contiguous = argparse.Namespace(**{**vars(args), "channels_last": False, "compile": False})
    model, full_params = build_model(contiguous, factorized)
    local = copy.deepcopy(model)  # the same weights, never sharded: compute-only steps
    alone = Replica(local, local, make_optimizer(args, method, local))
    fsdp.shard(model)
    replica = Replica(model, model, make_optimizer(args, method, model))
    batches = iter(minibatches)
    for _ in range(args.warmup):
        train_one_step(replica, next(batches))
    train_one_step(alone, minibatches[0])  # the local optimizer's state allocated, untimed

    compute: list[float] = []
    steps: list[float] = []
    for i in range(max(args.steps, args.compute_steps)):
        if i < args.compute_steps:
            batch = next(batches)
            compute.append(timed(lambda b=batch: train_one_step(alone, b)))
        if i < args.steps:
            dist.barrier()  # ranks start together, as the previous step's collectives align them
            batch = next(batches)
            steps.append(timed(lambda b=batch: train_one_step(replica, b)))

    moved = fsdp.comm_bytes(model, dist.get_world_size(), args.grad_accum)
    return {
        "rank": dist.get_rank(), "step_times": steps, "compute_times": compute,
        "step_time": statistics.median(steps), "torch_step_time": None,
        "step_time_quartiles": quartiles(steps),
        "compute_time": statistics.median(compute), "compute_time_quartiles": quartiles(compute),
        "compress_time": 0.0, "hook_time": 0.0,
        "bytes_per_step": moved.payload, "ring_bytes_per_step": moved.ring,
        "dense_bytes_per_step": moved.payload, "collectives_per_step": float(moved.collectives),
        "all_gather_bytes_per_step": moved.all_gather,
        "reduce_scatter_bytes_per_step": moved.reduce_scatter,
        **fsdp.sharded_state_bytes(model, replica.optimizer),
        "params": sum(p.numel() for p in model.parameters()), "params_full": full_params,
        "factorized": factorized, "hook": HOOK_NAME, "bucket_mib": None, "bucket_trial_ms": None,
    }
