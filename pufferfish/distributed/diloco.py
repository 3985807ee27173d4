"""DiLoCo (Douillard et al., 2023): infrequent synchronization with an outer Nesterov SGD.

Each worker takes ``inner_steps`` optimizer steps alone (no DDP, no gradient all-reduce); then the
workers average their *pseudo-gradients* (the last synchronized weights minus their own) with one
all-reduce and an outer SGD with Nesterov momentum applies the average to the synchronized
weights, which every worker copies. Floating-point buffers (BatchNorm statistics) are averaged
with it, so after a synchronization every replica is identical.

The outer optimizer is a ``torch.optim.SGD(nesterov=True)`` over the model's own parameters: at
the outer step each parameter holds the synchronized weights and the averaged pseudo-gradient as
its ``.grad``. Its state is therefore keyed by the model's parameters like the inner optimizer's,
so a method that carries optimizer state across a change of the model (Pufferfish's momentum
projected onto the factors) carries the outer momentum the same way.

Built on ``torch.distributed`` directly: torchft's ``DiLoCo`` needs its ``Manager``, a Rust
server that registers with a lighthouse, rather than a plain process group (docs/design.md).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .hooks.accounting import CommStats
from .hooks.state import check_setting

__all__ = ["DiLoCoState"]


class DiLoCoState:
    """Settings, synchronized weights and outer optimizer of a DiLoCo run; one per model.

    :meth:`bind` attaches it to a model (checking that every rank holds the same weights),
    :meth:`inner_step_done` counts inner steps and runs :meth:`sync` every ``inner_steps``.
    ``stats`` counts the bytes each synchronization hands to its all-reduce.
    """

    def __init__(self, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 process_group: dist.ProcessGroup | None = None) -> None:
        check_setting("inner_steps", inner_steps,
                      isinstance(inner_steps, int) and inner_steps >= 1, "an integer >= 1")
        check_setting("outer_lr", outer_lr, outer_lr > 0 and outer_lr < float("inf"),
                      "a number > 0")
        check_setting("outer_momentum", outer_momentum, 0 <= outer_momentum < 1,
                      "0 <= outer_momentum < 1")
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.process_group = process_group
        self.stats = CommStats()
        self.steps_since_sync = 0  # inner steps since the last synchronization
        self.outer_steps = 0  # synchronizations so far (all of the run)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.SGD | None = None
        self._params: list[nn.Parameter] = []
        self._synced: list[torch.Tensor] = []  # the parameters at the last synchronization

    # -- set-up -----------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> DiLoCoState:
        """Attach to ``model`` as it is now (its weights become the synchronized ones).

        Every rank must hold the same weights (the same seed, or the same factors after a
        switch): a checksum is compared over ranks, and if they differ rank 0's weights and
        buffers are broadcast (as DDP's wrap does), so the replicas start identical.
        """
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._agree():
            with torch.no_grad():
                for t in [*self._params, *model.buffers()]:
                    dist.broadcast(t.data, 0, group=self.process_group)
        self._synced = [p.detach().clone() for p in self._params]
        self.optimizer = torch.optim.SGD(self._params, lr=self.outer_lr,
                                         momentum=self.outer_momentum,
                                         nesterov=self.outer_momentum > 0)
        self.steps_since_sync = 0
        return self

    def fresh(self) -> DiLoCoState:
        """A state with the same settings and counters, not bound (after a change of the model)."""
        new = type(self)(self.inner_steps, self.outer_lr, self.outer_momentum, self.process_group)
        new.outer_steps = self.outer_steps
        return new

    def checksums(self) -> torch.Tensor:
        """One float64 checksum per parameter and buffer (sum and sum of squares)."""
        tensors = [*self._params, *(self.model.buffers() if self.model is not None else [])]
        if not tensors:
            return torch.zeros(2, dtype=torch.float64)
        return torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().square().sum()])
                            for t in tensors]).flatten()

    def _agree(self) -> bool:
        """Whether every rank's checksums equal rank 0's."""
        mine = self.checksums()
        theirs = mine.clone()
        dist.broadcast(theirs, 0, group=self.process_group)
        disagree = torch.tensor([0.0 if torch.equal(mine, theirs) else 1.0])
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
        world = dist.get_world_size(self.process_group)
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            deltas = [s - p.detach() for s, p in zip(self._synced, self._params)]
            flat = torch.cat([t.reshape(-1).float() for t in [*deltas, *buffers]]) \
                if deltas or buffers else torch.zeros(0)
            payload = flat.numel() * flat.element_size()
            self.stats.add_bucket(payload)
            start = time.perf_counter()
            dist.all_reduce(flat, group=self.process_group)
            self.stats.add_hook_time(time.perf_counter() - start)
            self.stats.add_collective("allreduce", payload, world)
            flat /= world
            offset = 0
            for p, s, d in zip(self._params, self._synced, deltas):
                n = d.numel()
                p.copy_(s)
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
                offset += n
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

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state, the synchronized weights and the counters."""
        assert self.optimizer is not None, "bind() a model first"
        return {"optimizer": self.optimizer.state_dict(), "synced": [s.clone() for s in self._synced],
                "steps_since_sync": self.steps_since_sync, "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None, "bind() a model first"
        if len(state["synced"]) != len(self._synced):
            raise ValueError(f"DiLoCo state holds {len(state['synced'])} synchronized tensors, "
                             f"the model {len(self._synced)}")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for s, saved in zip(self._synced, state["synced"]):
                s.copy_(saved)
        self.steps_since_sync = state["steps_since_sync"]
        self.outer_steps = state["outer_steps"]
