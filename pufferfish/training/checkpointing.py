"""Writing a run's checkpoint: every component's state by name, collected from every rank.

The components save their own state (:func:`~pufferfish.training.build.components`); this
checks they are finite, gathers the per-rank ones and has rank 0 write one file (and, under
FSDP2, every rank its shards) through :mod:`pufferfish.training.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from . import checkpoint as ckpt
from .build import components, sharded_state
from .guards import TrainingError, all_finite, signals_deferred
from .methods import Method
from .run import Run
from .tasks import Task


def checkpoint(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
               run_dir: Path) -> None:
    """Rank 0 writes every component's state (:func:`components`); every rank learns whether
    it worked.

    Per-rank states are all-gathered so one file resumes every rank exactly. The outcome is
    broadcast instead of a bare barrier, so a failed write (disk full, permissions) stops every
    rank at once with rank 0's message, not rank 0 alone while the others wait out the timeout.
    """
    progress = run.progress
    finite = all_finite([*run.model.state_dict().values(), *_tensors(run.optimizer.state)])
    if dist_env.all_reduce_sum([0.0 if finite else 1.0], env)[0]:
        # The steps' losses and gradients were finite but the update overflowed the weights.
        raise TrainingError(
            f"non-finite parameters or optimizer state after epoch {progress.epoch}, step "
            f"{progress.step_in_epoch} (global step {progress.global_step}): not saved; last "
            f"good checkpoint: {run.last_checkpoint or 'none'}; lower --lr or set --grad-clip")
    run.buckets.settle(run)  # a checkpoint holds a bucket choice, never half a trial
    shared, per_rank = components(run, method, task)
    sharded = {}
    if cfg.parallel == "fsdp":  # model and optimizer: every rank writes its shards (DCP)
        with signals_deferred():
            sharded = {"sharded": ckpt.save_sharded(run_dir, progress.global_step,
                                                    sharded_state(run), env.is_main)}
        del shared["model"]
        shared.pop("optimizer", None), per_rank.pop("optimizer", None)
        if run.mesh is not None:
            sharded["replicas"] = run.mesh.size(0)
    ranks = dist_env.gather_object(_states(per_rank), env)
    written = error = None
    if env.is_main:
        payload = {"config": cfg.to_dict(), "world_size": env.world_size, **_states(shared),
                   "ranks": ranks, **sharded}
        try:
            with signals_deferred():  # Ctrl-C / SIGTERM wait for the write (or its cleanup)
                written = str(ckpt.save_checkpoint(run_dir, payload, progress.global_step,
                                                   keep_last=cfg.keep_checkpoints))
        except ckpt.CheckpointError as e:
            error = str(e)
    # Also the barrier: nobody runs ahead of a checkpoint that is still being written.
    written, error = dist_env.broadcast_object((written, error), env)
    if error is not None:
        raise ckpt.CheckpointError(error if env.is_main else f"rank 0 failed: {error}")
    run.last_checkpoint = Path(written)  # every rank can name the last good checkpoint


def _states(components: dict[str, Any]) -> dict[str, Any]:
    """Each component's ``state_dict()`` by name (None for a component this run has not)."""
    return {name: None if c is None else c.state_dict() for name, c in components.items()}


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (the optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []

