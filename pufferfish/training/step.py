"""One training step, and the meter of an epoch's steps.

:func:`train_step` is the step of every training run (``pufferfish train``, whatever the task and
method) and of the step-time benchmark (``pufferfish bench``): forward under autocast, backward
(scaled under AMP), clipping, then the update, or, when a vote finds something non-finite on any
rank, no update on every rank. :class:`EpochMeter` counts and times an epoch's steps; its counters
are one process's progress within the epoch, saved by mid-epoch checkpoints.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["EpochMeter", "Replica", "train_step"]


@dataclass
class Replica:
    """What one process trains: the model, its DDP wrapper (or itself), optimizer, AMP scaler."""

    model: nn.Module  # the unwrapped model
    wrapped: nn.Module  # what the forward pass goes through (DDP, or the model itself)
    optimizer: torch.optim.Optimizer
    scaler: Any = None  # torch.amp.GradScaler under AMP on CUDA
    hook_state: Any = None  # the comm hook's state (memory, byte counters), None without DDP


def train_step(replica: Replica, compute_loss: Callable[[], torch.Tensor], *,
               autocast: contextlib.AbstractContextManager | None = None, grad_clip: float = 0.0,
               vote: Callable[[torch.Tensor], str | None] | None = None,
               undo: Callable[[], None] | None = None) -> tuple[torch.Tensor, str | None]:
    """One optimizer step on ``compute_loss()``; returns the loss and what was non-finite.

    ``vote(loss)``, after backward and clipping, says what is non-finite on any rank (None:
    nothing); then the update is skipped: gradients dropped, ``undo()`` restores what the forward
    pass changed (BatchNorm statistics, a task's carried state), the scaler lowers its scale.
    """
    with autocast or contextlib.nullcontext():
        loss = compute_loss()
    optimizer, scaler = replica.optimizer, replica.scaler
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(replica.model.parameters(), grad_clip)
    bad = vote(loss) if vote is not None else None
    if bad is not None:
        optimizer.zero_grad(set_to_none=True)  # the step is skipped on every rank
        if undo is not None:
            undo()
        if scaler is not None:
            scaler.update()
    elif scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return loss, bad


class EpochMeter:
    """Loss sum and step counts of the current epoch (saved mid-epoch), and its timers.

    A mid-epoch resume continues the counters where the checkpoint left them, so the epoch's mean
    loss is summed in the same order as without the interruption; the timers and ``local_steps``
    cover only the steps this process took.
    """

    def __init__(self) -> None:
        self.loss_sum = torch.tensor(0.0, dtype=torch.float64)
        self.n_steps = 0  # steps whose update was applied
        self.skipped = 0  # steps whose update was skipped (--nonfinite skip)
        self.start()

    def start(self) -> None:
        """The epoch (or its resumed remainder) starts now."""
        self.local_steps = 0
        self.compute_time = self.data_time = 0.0
        self.last_data_time = self.last_step_time = 0.0  # the latest step's (--logger)
        self.started = self._mark = time.perf_counter()

    def batch_ready(self) -> None:
        """The next batch is here: the wait since the last step was data loading."""
        now = time.perf_counter()
        self.last_data_time = now - self._mark
        self.data_time += self.last_data_time
        self._mark = now

    def step_done(self, loss: torch.Tensor, applied: bool) -> None:
        if applied:
            self.loss_sum += loss.detach().double().cpu()
            self.n_steps += 1
        else:
            self.skipped += 1
        self.local_steps += 1
        now = time.perf_counter()
        self.compute_time += now - self._mark
        self.last_step_time = self.last_data_time + now - self._mark  # waiting for data included
        self._mark = now

    def finish(self) -> dict[str, Any]:
        """This epoch's counters and times (loss not yet reduced over ranks); counters to zero."""
        out = {"loss_sum": self.loss_sum.item(), "n_steps": self.n_steps,
               "skipped_steps": self.skipped, "local_steps": self.local_steps,
               "epoch_time": time.perf_counter() - self.started,
               "compute_time": self.compute_time, "data_time": self.data_time}
        self.load_state_dict({})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum.item(), "n_steps": self.n_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum = torch.tensor(state.get("loss_sum", 0.0), dtype=torch.float64)
        self.n_steps = state.get("n_steps", 0)
        self.skipped = state.get("skipped", 0)
