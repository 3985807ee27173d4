"""DiLoCo (Douillard et al., 2023): infrequent synchronization with an outer Nesterov SGD.

Each worker takes ``inner_steps`` optimizer steps alone (no DDP, no gradient all-reduce); then the
workers average their *pseudo-gradients* (the last synchronized weights minus their own) with one
all-reduce and an outer SGD with Nesterov momentum applies the average to the synchronized
weights, which every worker copies. Floating-point buffers (BatchNorm statistics) are averaged
with it, so after a synchronization every replica is identical.

Those averaged statistics do not fit the synchronized weights: each replica's were gathered at its
own weights, and the outer step moves the weights past all of them (Nesterov, ``outer_lr`` 0.7,
momentum 0.9: 1.33 times the mean pseudo-gradient at the first outer step, up to 7 times once
the momentum has built up). Measured on a ResNet-18 (width 0.25, 2,048 Fashion-MNIST images, 2
epochs, 2 processes, ``inner_steps`` 4): the averaged running variances were about 0.6 of the
synchronized weights' own in every BatchNorm layer, the error compounds over the layers, and the
model evaluated and saved scored 10% (test loss 394) where the same weights with their
statistics recomputed score 51% (DDP: 48%); with plain averaging (``outer_lr`` 1, momentum 0)
the averaged statistics nearly fit (58% as saved, 61% recomputed). Carrying them through the
outer step instead (extrapolated like the weights) would take a statistic to be linear in the
weights, and an extrapolated variance can turn negative. So before the synchronized model is
evaluated or checkpointed, :meth:`DiLoCoState.recompute_batchnorm` recomputes its statistics:
forward passes in training mode on a few training batches per process (a cumulative average, as
"precise BN" does), then averaged over the processes. Training never reads them (BatchNorm
normalizes a training batch by its own statistics), so the weights' trajectory is unchanged;
only what is evaluated, saved and returned changes.

The outer optimizer is a ``torch.optim.SGD(nesterov=True)`` over the model's own parameters: at
the outer step each parameter holds the synchronized weights and the averaged pseudo-gradient as
its ``.grad``. Its state is therefore keyed by the model's parameters like the inner optimizer's,
so a method that carries optimizer state across a change of the model (Pufferfish's momentum
projected onto the factors) carries the outer momentum the same way.

Under FSDP2 (``--parallel fsdp``, :mod:`.replicas`) the parameters are DTensors: everything here
works on each process's local shard (``DTensor.to_local()``) and all-reduces over
``process_group``, the replicate group, so the bytes of an outer step are this process's shard of
the pseudo-gradients (about ``1 / shard_size`` of plain DiLoCo's); the synchronized weights and
the outer momentum stay sharded like the parameters (:meth:`sharded_state_dict`).

Built on ``torch.distributed`` directly: torchft's ``DiLoCo`` needs its ``Manager``, a Rust
server that registers with a lighthouse, rather than a plain process group (docs/design.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from types import EllipsisType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .env import collective_device
from .fsdp import is_dtensor
from .fsdp import local as _local  # this process's shard of a DTensor, or the tensor
from .hooks.accounting import CommStats
from .hooks.state import check_setting

__all__ = ["DiLoCoState"]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)


class DiLoCoState:
    """Settings, synchronized weights and outer optimizer of a DiLoCo run; one per model.

    :meth:`bind` attaches it to a model (checking that every rank holds the same weights),
    :meth:`inner_step_done` counts inner steps and runs :meth:`sync` every ``inner_steps``.
    ``stats`` counts the bytes each synchronization hands to its all-reduce.
    """

    def __init__(self, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 process_group: dist.ProcessGroup | None = None,
                 buffer_group: dist.ProcessGroup | EllipsisType | None = ...) -> None:
        check_setting("inner_steps", inner_steps,
                      isinstance(inner_steps, int) and inner_steps >= 1, "an integer >= 1")
        check_setting("outer_lr", outer_lr, outer_lr > 0 and outer_lr < float("inf"),
                      "a number > 0")
        check_setting("outer_momentum", outer_momentum, 0 <= outer_momentum < 1,
                      "0 <= outer_momentum < 1")
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.process_group = process_group
        # The float buffers' group (default: process_group). Under FSDP2 every process: the
        # processes of one replica update their BatchNorm statistics on their own batches.
        self.buffer_group = process_group if buffer_group is ... else buffer_group
        self.stats = CommStats()
        self.steps_since_sync = 0  # inner steps since the last synchronization
        self.outer_steps = 0  # synchronizations so far (all of the run)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.SGD | None = None
        self._params: list[nn.Parameter] = []
        self._synced: list[torch.Tensor] = []  # the parameters at the last synchronization
        self._recomputed_at = -1  # outer_steps when the BatchNorm statistics were last recomputed

    # -- set-up -----------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> DiLoCoState:
        """Attach to ``model`` as it is now (its weights become the synchronized ones).

        Every rank must hold the same weights (the same seed, or the same factors after a
        switch): a checksum is compared over ranks, and if they differ rank 0's weights and
        buffers are broadcast (as DDP's wrap does), so the replicas start identical.
        """
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        if not self._agree():
            with torch.no_grad():
                for t in [*self._params, *model.buffers()]:
                    dist.broadcast(_local(t.data), group=self.process_group, group_src=0)
        self._synced = [p.detach().clone() for p in self._params]
        self.optimizer = torch.optim.SGD(self._params, lr=self.outer_lr,
                                         momentum=self.outer_momentum,
                                         nesterov=self.outer_momentum > 0)
        self.steps_since_sync = 0
        return self

    def fresh(self) -> DiLoCoState:
        """A state with the same settings and counters, not bound (after a change of the model)."""
        new = type(self)(self.inner_steps, self.outer_lr, self.outer_momentum, self.process_group,
                         self.buffer_group)
        new.outer_steps = self.outer_steps
        return new

    def checksums(self) -> torch.Tensor:
        """One float64 checksum per parameter and buffer (sum and sum of squares)."""
        tensors = [*self._params, *(self.model.buffers() if self.model is not None else [])]
        if not tensors:  # on the device collectives run on (NCCL takes no CPU tensor)
            return torch.zeros(2, dtype=torch.float64, device=collective_device(self.process_group))
        local = [_local(t.detach()).double() for t in tensors]
        return torch.stack([torch.stack([t.sum(), t.square().sum()]) for t in local]).flatten()

    def _agree(self) -> bool:
        """Whether every rank's checksums equal rank 0's."""
        mine = self.checksums()
        theirs = mine.clone()
        dist.broadcast(theirs, group=self.process_group, group_src=0)
        disagree = torch.tensor([0.0 if torch.equal(mine, theirs) else 1.0], device=mine.device)
        dist.all_reduce(disagree, group=self.process_group)
        return disagree.item() == 0

    # -- training ---------------------------------------------------------------------------
    @property
    def at_boundary(self) -> bool:
        """No inner step since the last synchronization: every replica is identical."""
        return self.steps_since_sync == 0

    def inner_step_done(self, global_step: int, end_of_epoch: bool = False) -> bool:
        """After an inner optimizer step (``global_step`` steps taken in all): synchronize when
        the step is a multiple of ``inner_steps``, or ends an epoch (so evaluation, checkpoints
        and method changes see synchronized weights). Returns whether it synchronized."""
        self.steps_since_sync += 1
        if global_step % self.inner_steps == 0 or end_of_epoch:
            self.sync()
            return True
        return False

    def sync(self) -> None:
        """One outer step: average the pseudo-gradients and the float buffers over ranks, apply
        the outer Nesterov SGD to the synchronized weights, copy them into the model."""
        assert self.model is not None and self.optimizer is not None, "bind() a model first"
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        apart = self.buffer_group is not self.process_group  # buffers in a second all-reduce
        with torch.no_grad():
            deltas = [s - p.detach() for s, p in zip(self._synced, self._params)]  # shard-wise
            local = [_local(d) for d in deltas]
            flat = _flat([*local, *([] if apart else buffers)])
            flats = [(flat, self.process_group), *([(_flat(buffers), self.buffer_group)]
                                                   if apart and buffers else [])]
            self.stats.add_bucket(sum(f.nbytes for f, _ in flats))  # one bucket per outer step
            start = time.perf_counter()
            for f, group in flats:
                dist.all_reduce(f, group=group)
                self.stats.add_collective("allreduce", f.nbytes, dist.get_world_size(group))
                f /= dist.get_world_size(group)
            self.stats.add_hook_time(time.perf_counter() - start)
            offset = 0
            for p, s, d, mine in zip(self._params, self._synced, deltas, local):
                n = mine.numel()
                p.copy_(s)
                mine.copy_(flat[offset:offset + n].view_as(mine))  # d: p's layout, averaged
                p.grad = d
                offset += n
            if apart:
                flat, offset = flats[-1][0], 0
            for b in buffers:
                n = b.numel()
                b.copy_(flat[offset:offset + n].view_as(b))
                offset += n
        self.optimizer.step()
        with torch.no_grad():
            for p, s in zip(self._params, self._synced):
                p.grad = None
                s.copy_(p)
        self.steps_since_sync = 0
        self.outer_steps += 1

    def recompute_batchnorm(self, batches: Iterable[Any], forward: Callable[[Any], object]) -> int:
        """The synchronized weights' own BatchNorm statistics (see the module's docstring):
        reset, ``forward(batch)`` in training mode under no_grad for each of ``batches`` (a
        cumulative average over them), then averaged over ``buffer_group``; the momentum and
        ``num_batches_tracked`` are put back. Only at a boundary, once per outer step (the same
        batches give the same result). Returns the batches used (0: nothing to do)."""
        assert self.model is not None, "bind() a model first"
        norms = [m for m in self.model.modules()
                 if isinstance(m, _BatchNorm) and m.track_running_stats]
        if not norms or not self.at_boundary or self._recomputed_at == self.outer_steps:
            return 0
        batches = list(batches)
        if not batches:
            return 0
        kept = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
        training = self.model.training
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # running stats: the plain mean over the batches
        self.model.train()
        with torch.no_grad():
            for batch in batches:
                forward(batch)
            for m, (momentum, tracked) in zip(norms, kept):
                m.momentum = momentum
                m.num_batches_tracked.copy_(tracked)
            stats = [t for m in norms for t in (m.running_mean, m.running_var)]
            flat = _flat(stats)
            dist.all_reduce(flat, group=self.buffer_group)  # not counted: not the method's bytes
            flat /= dist.get_world_size(self.buffer_group)
            offset = 0
            for t in stats:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self.model.train(training)
        self._recomputed_at = self.outer_steps
        return len(batches)

    # -- checkpoint -------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 shards (DTensors)."""
        return any(is_dtensor(p) for p in self._params)

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state, the synchronized weights and the counters; when
        :attr:`sharded`, the counters only (the tensors: :meth:`sharded_state_dict`)."""
        assert self.optimizer is not None, "bind() a model first"
        counters = {"steps_since_sync": self.steps_since_sync, "outer_steps": self.outer_steps}
        if self.sharded:
            return counters
        return {"optimizer": self.optimizer.state_dict(),
                "synced": [s.clone() for s in self._synced], **counters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None, "bind() a model first"
        if self.sharded != ("synced" not in state):
            raise ValueError("DiLoCo state was saved with the model "
                             f"{'un' if 'synced' in state else ''}sharded, now it is "
                             f"{'' if self.sharded else 'un'}sharded")
        if not self.sharded:
            if len(state["synced"]) != len(self._synced):
                raise ValueError(f"DiLoCo state holds {len(state['synced'])} synchronized "
                                 f"tensors, the model {len(self._synced)}")
            self.optimizer.load_state_dict(state["optimizer"])
            with torch.no_grad():
                for s, saved in zip(self._synced, state["synced"]):
                    s.copy_(saved)
        self.steps_since_sync = state["steps_since_sync"]
        self.outer_steps = state["outer_steps"]

    def sharded_state_dict(self) -> dict[str, Any]:
        """The synchronized weights and the outer optimizer's state by parameter name, as
        DTensors, for ``torch.distributed.checkpoint`` (each process writes its own shards; a
        DCP load fills them in place, then :meth:`load_sharded_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None and self.optimizer is not None, "bind() a model first"
        return {"synced": dict(zip(self._names, self._synced)),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Put :meth:`sharded_state_dict`, filled by a DCP load, back (the synchronized weights
        were loaded in place)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        assert self.model is not None and self.optimizer is not None, "bind() a model first"
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
