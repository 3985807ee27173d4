"""The loop's guards: failures of the process group, non-finite values, signals during writes.

A peer that crashes or freezes becomes one line (:class:`PeerError`); a non-finite loss, gradient
or buffer is voted on by every rank so all stop (or skip the step) together; a file write holds
Ctrl-C and SIGTERM until it is done (``docs/reliability.md``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import env as dist_env
from ..distributed import fsdp
from ..distributed.env import DistEnv
from . import checkpoint as ckpt
from .checkpoint import signals_deferred
from .tasks import Task


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, incompatible checkpoint); one-line message."""


class PeerError(RuntimeError):
    """Another process of the group crashed, was killed or froze; this one cannot continue.

    Separate from :class:`TrainingError` because nothing is wrong with this process's input: the
    CLI reports it in one line with exit status 1 (not 2), and the reason is in the peer's log.
    """


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; the message says how to continue it (or that nothing is
    saved yet to continue from)."""


_PEER_FAILURE = re.compile(r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe|"
                           r"[Ss]ocket|peer|[Gg]loo|NCCL|[Ww]atchdog")


def is_peer_failure(e: BaseException) -> bool:
    """A failure of the process group (peer gone or frozen), not of this process's work."""

    return isinstance(e, dist.DistError) or bool(_PEER_FAILURE.search(str(e)))


def gloo_text(e: BaseException) -> str:
    """The first line of a c10d/gloo error without its source-file prefix."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0] if lines else type(e).__name__)
    text = text.split(". This is typically")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def snapshot(model: nn.Module, task: Task) -> Callable[[], None]:
    """A function that restores the model's buffers and the task's carried state as they are now."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    carried = task.state_dict()

    def restore() -> None:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        task.load_state_dict(carried)

    return restore


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is finite; the max-abs norm is exact (a 2-norm of huge but finite
    values overflows to inf) and propagates NaN."""
    tensors = [fsdp.local(t) for t in tensors if t.is_floating_point()]  # a shard: voted per rank
    return not tensors or math.isfinite(nn.utils.get_total_norm(tensors, math.inf).item())


def nonfinite_votes(loss: torch.Tensor, grads: list[torch.Tensor],
                    buffers: list[torch.Tensor], env: DistEnv) -> str | None:
    """What is non-finite on any rank (None: nothing); the same answer on every rank.

    Each rank votes on its loss, its gradients and its buffers (the forward pass has just updated
    the BatchNorm statistics: a batch can overflow them while the loss is still finite), and the
    votes are summed over ranks, so a NaN on one rank stops (or skips the step on) all of them
    together: a rank that stopped alone would leave the others waiting in the next collective.
    """
    votes = [0.0 if math.isfinite(loss.item()) else 1.0, 0.0 if all_finite(grads) else 1.0,
             0.0 if all_finite(buffers) else 1.0]
    votes = dist_env.all_reduce_sum(votes, env)
    if not any(votes):
        return None
    names = (f"loss {loss.item()}" if not env.distributed else "loss", "gradient",
             "buffers (BatchNorm statistics)")
    return " and ".join(
        name + (f" on {int(v)} of {env.world_size} ranks" if env.distributed else "")
        for name, v in zip(names, votes) if v)


def write_text(path: Path, text: str) -> None:
    """Write a small run-directory file atomically: a kill leaves the old file or the new one."""
    with signals_deferred():
        ckpt.atomic_write_text(path, text)

