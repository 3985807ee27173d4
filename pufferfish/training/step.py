"""One training step, and the meter of an epoch's steps.

:func:`train_step` is the step of every training run (``pufferfish train``, whatever the task and
method) and of the step-time benchmark (``pufferfish bench``): forward under autocast, backward
(scaled under AMP), clipping, then the update, or, when a vote finds something non-finite on any
rank, no update on every rank. :class:`EpochMeter` counts and times an epoch's steps; its counters
are one process's progress within the epoch, saved by mid-epoch checkpoints.

Gradient accumulation (``--grad-accum N``): a step is N micro-batches (:func:`micro_batch_groups`
groups a loader's batches), each loss divided by N, so the gradient is that of one batch N times
larger; the gradients are synchronized once, in the last micro-batch's backward (DDP's
``no_sync``, FSDP2's ``set_requires_gradient_sync``), so a comm hook (PowerSGD's error feedback
included) runs once per optimizer step, and clipping, the non-finite vote and the AMP scaler too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed import fsdp

__all__ = ["EpochMeter", "Replica", "micro_batch_groups", "timed", "to_device", "train_step"]

LossFn = Callable[[], torch.Tensor]


@dataclass
class Replica:
    """What one process trains: the model, its DDP wrapper (or itself), optimizer, AMP scaler."""

    model: nn.Module  # the unwrapped model
    wrapped: nn.Module  # what the forward pass goes through (DDP, or the model itself)
    optimizer: torch.optim.Optimizer
    scaler: Any = None  # torch.amp.GradScaler under AMP on CUDA
    hook_state: Any = None  # the comm hook's state (memory, byte counters), None without DDP
    autocast: Any = None  # the forward's autocast when train_step is given none (bench --amp)


def train_step(replica: Replica, compute_loss: LossFn | Sequence[LossFn], *,
               autocast: contextlib.AbstractContextManager | None = None, grad_clip: float = 0.0,
               vote: Callable[[torch.Tensor], str | None] | None = None,
               undo: Callable[[], None] | None = None) -> tuple[torch.Tensor, str | None]:
    """One optimizer step on ``compute_loss()``; returns the loss and what was non-finite.

    ``compute_loss`` may be a sequence, one closure per micro-batch (gradient accumulation, see
    the module docs): the loss returned is then their mean, detached.
    ``vote(loss)``, after backward and clipping, says what is non-finite on any rank (None:
    nothing); then the update is skipped: gradients dropped, ``undo()`` restores what the forward
    pass changed (BatchNorm statistics, a task's carried state), the scaler lowers its scale.
    """
    optimizer, scaler = replica.optimizer, replica.scaler
    autocast = autocast if autocast is not None else replica.autocast
    optimizer.zero_grad(set_to_none=True)
    losses = [compute_loss] if callable(compute_loss) else list(compute_loss)
    loss = _backward(replica, losses, autocast)
    if scaler is not None:
        scaler.unscale_(optimizer)
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


def _backward(replica: Replica, losses: list[LossFn],
              autocast: contextlib.AbstractContextManager | None) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients synchronized in the last one only;
    the loss (one micro-batch), or the micro-batches' mean loss (detached)."""
    n, total = len(losses), None
    for k, compute in enumerate(losses):
        with _sync_deferred(replica.wrapped) if k < n - 1 else contextlib.nullcontext():
            with autocast or contextlib.nullcontext():
                loss = compute()
            part = loss / n if n > 1 else loss
            (part if replica.scaler is None else replica.scaler.scale(part)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None, "a step needs at least one micro-batch"
    return loss if n == 1 else total / n


def _sync_deferred(wrapped: nn.Module) -> contextlib.AbstractContextManager:
    """No gradient synchronization in this micro-batch's backward: DDP's ``no_sync``, FSDP2's
    gradient sync off; nothing to defer without either (one process, DiLoCo's inner steps)."""
    if isinstance(wrapped, DistributedDataParallel):
        return wrapped.no_sync()
    if fsdp.is_sharded(wrapped):
        return fsdp.gradient_sync_off(wrapped)
    return contextlib.nullcontext()


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> float:
    """Seconds ``fn()`` took, its GPU work included: on CUDA (``device``'s type, or by default
    whenever CUDA was initialized) the device is synchronized before and after, since kernels
    run asynchronously and the host's clock would otherwise see only their launches."""
    cuda = (device.type == "cuda") if device is not None else torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def micro_batch_groups(loader: Iterable[Any], n: int) -> Iterator[list[Any]]:
    """``loader``'s batches in consecutive groups of ``n``, one group per optimizer step. An
    epoch's last group, when incomplete, is dropped: every step averages ``n`` micro-batches (the
    same gradient scale, the same samples per step on every rank)."""
    group: list[Any] = []
    for batch in loader:
        group.append(batch)
        if len(group) == n:
            yield group
            group = []


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


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device``: tensors, and the tuples, lists and dicts
    (a Hugging Face model's keyword inputs) that hold them; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
