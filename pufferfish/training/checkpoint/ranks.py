"""A checkpoint written by a group of ranks: per-rank states gathered, rank 0 writes one file.

The training run hands over its components by name (:func:`pufferfish.training.build.checkpoint`
collects them and checks they are finite); this gathers the per-rank ones, has rank 0 write one
file (and, under FSDP2, every rank its shards) and tells every rank how the write went.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...distributed import env as dist_env
from ...distributed.env import DistEnv
from ..step import to_device
from .atomic import signals_deferred
from .errors import CheckpointError
from .save import save_checkpoint
from .sharded import save_sharded


def save_from_ranks(env: DistEnv, run_dir: Path, step: int, header: dict[str, Any],
                    shared: dict[str, Any], per_rank: dict[str, Any], *, keep_last: int,
                    sharded_state: Callable[[], dict[str, Any]] | None = None,
                    replicas: int | None = None) -> Path:
    """Rank 0 writes ``header`` and every component's state; every rank learns whether it worked
    and gets the checkpoint's path.

    Per-rank states are gathered to rank 0 (on the CPU) so one file resumes every rank exactly. The outcome is
    broadcast instead of a bare barrier, so a failed write (disk full, permissions) stops every
    rank at once with rank 0's message, not rank 0 alone while the others wait out the timeout.
    ``sharded_state`` (FSDP2): the model and optimizer as DCP shards, every rank writing its own,
    in place of their entries; ``replicas``: the replica count recorded beside them.
    """
    sharded: dict[str, Any] = {}
    if sharded_state is not None:  # model and optimizer: every rank writes its shards (DCP)
        with signals_deferred():
            sharded = {"sharded": save_sharded(run_dir, step, sharded_state(), env.is_main)}
        del shared["model"]
        shared.pop("optimizer", None), per_rank.pop("optimizer", None)
        if replicas is not None:
            sharded["replicas"] = replicas
    # on the CPU: a rank's GPU tensors (a comm hook's memory, DiLoCo's inner optimizer) pickled
    # as they are would be restored on their GPU in rank 0 (a checkpoint loads on the CPU anyway)
    ranks = dist_env.gather_to_main(to_device(_states(per_rank), torch.device("cpu")), env)
    written = error = None
    if env.is_main:
        payload = {**header, **_states(shared), "ranks": ranks, **sharded}
        try:
            with signals_deferred():  # Ctrl-C / SIGTERM wait for the write (or its cleanup)
                written = str(save_checkpoint(run_dir, payload, step, keep_last=keep_last))
        except CheckpointError as e:
            error = str(e)
    # Also the barrier: nobody runs ahead of a checkpoint that is still being written.
    written, error = dist_env.broadcast_object((written, error), env)
    if error is not None:
        raise CheckpointError(error if env.is_main else f"rank 0 failed: {error}")
    return Path(written)  # every rank can name the last good checkpoint


def _states(components: dict[str, Any]) -> dict[str, Any]:
    """Each component's ``state_dict()`` by name (None for a component this run has not)."""
    return {name: None if c is None else c.state_dict() for name, c in components.items()}
