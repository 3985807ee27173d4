"""When the switch happens, and what the optimizer carries across it: every rule, in one file.

**When** (:class:`SwitchSchedule`, counted in optimizer steps; epoch E starts at step E x the
steps per epoch). ``warmup_epochs=N``: before the first step of epoch N; ``"P%"``: N is P% of the
epochs rounded up, never the last epoch (in a 1-epoch run, P% of its steps instead, mid-epoch).
``warmup_steps=S``: before global step S (a fraction < 1: of the run's steps, at least 1); under
DiLoCo at the next outer-step boundary from there (every ``inner_steps`` steps, each epoch start;
the epoch forms are boundaries already).
``"auto"``: at the first epoch start after every stable rank settled, observed every
``observe_every`` steps (4 times an epoch by default), from ``min_warmup`` epochs, at the latest at
the cap (``max_warmup``, or: a tenth of the run but at least 150 steps, at most half the run).
After the switch the LR ramps from 1/W of the schedule's back to it over W steps
(``switch_lr_warmup``; ``switch_momentum="auto"`` with AdamW: 5% of the run if the switch is past
the LR warm-up): ``pufferfish train`` applies it; with ``Recipe`` or a trainer, the user's
scheduler owns the LR (:meth:`SwitchSchedule.lr_scale` is the factor to apply).

**What the optimizer carries** (:func:`carry_state`, the same for ``pufferfish train``,
:class:`~pufferfish.Recipe` and the trainer callbacks). ``"reset"`` (the paper; ``"auto"`` too):
nothing. Every parameter of the model, surviving or new, starts with empty state: SGD momentum
from zero, Adam moments from zero and its step count (bias correction) from 0. ``"project"``:
surviving parameters keep their state; each factor gets its dense weight's state projected
(:func:`projected_state`: momentum and Adam's first moment by the chain rule, the second moment
through the squared factors, the step count kept).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..lowrank import LowRankModule
from ..options.groups import SWITCH_STATE

__all__ = ["OBSERVATIONS_PER_EPOCH", "SwitchSchedule", "carry_state", "install_state",
           "projected_momentum", "projected_state"]

OBSERVATIONS_PER_EPOCH = 4  # auto: stable ranks observed this often an epoch by default
# auto's default cap: a tenth of the run (the paper's warm-up) but at least this many optimizer
# steps, which the short-run grids needed (docs/benchmarks.md, "auto"); never after half the run.
CAP_FRACTION, CAP_MIN_STEPS = 0.1, 150
# switch_momentum auto with AdamW: the fresh moments take small steps until they have averaged a
# few gradients (ReLoRA's pairing; docs/benchmarks.md, "The fix: --switch-momentum auto").
AUTO_REWARM = 0.05


@dataclass(frozen=True)
class SwitchSchedule:
    """Every rule of *when*, as plain values (``epochs``: the run's, where the caller knows it).

    ``warmup``: N, ``"P%"`` or ``"auto"``; ``warmup_steps``: steps (or a fraction of the run),
    0 for off; ``max_warmup`` None: the default cap where ``epochs`` is known, else none;
    ``inner_steps``: DiLoCo's, else None; ``lr_rewarm``: the re-warm-up in steps (or a fraction);
    ``adamw``/``lr_warmup_epochs``: what ``switch_momentum="auto"``'s re-warm-up depends on.
    """

    warmup: int | str = 2
    warmup_steps: float = 0.0
    epochs: int | None = None
    min_warmup: float = 1
    max_warmup: float | None = None
    observe_every_steps: int = 0
    inner_steps: int | None = None
    momentum: str = "reset"
    lr_rewarm: float = 0.0
    adamw: bool = False
    lr_warmup_epochs: float = 0.0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> SwitchSchedule:
        """The schedule of a :class:`~pufferfish.config.TrainConfig` (``--mode lowrank``: the
        switch before step 0, nothing re-warmed)."""
        lowrank = cfg.mode == "lowrank"
        return cls(warmup=0 if lowrank else _parse_warmup(cfg.warmup_epochs),
                   warmup_steps=0.0 if lowrank else cfg.warmup_steps, epochs=cfg.epochs,
                   min_warmup=cfg.min_warmup_epochs, max_warmup=cfg.max_warmup_epochs if cfg.max_warmup_epochs > 0 else None,
                   observe_every_steps=cfg.stable_rank_every_steps,
                   inner_steps=cfg.inner_steps if cfg.sync == "diloco" else None,
                   momentum=cfg.switch_momentum,
                   lr_rewarm=0.0 if lowrank else cfg.switch_lr_warmup,
                   adamw=not lowrank and cfg.optimizer_name == "adamw",
                   lr_warmup_epochs=cfg.lr_warmup_epochs)

    # --- the switch point ---------------------------------------------------------------------

    @property
    def auto(self) -> bool:
        return self.warmup == "auto" and not self.warmup_steps

    @property
    def switch_epoch(self) -> int | str:
        """The epoch the switch is before, or ``"auto"``; ``P%`` rounded up, before the last
        epoch (10% of 20 epochs: 2; of 10 or 2: 1; of 1: 0, unless it switches in steps)."""
        if isinstance(self.warmup, str) and self.warmup.endswith("%"):
            if self.epochs is None:
                raise ValueError(f"warmup {self.warmup!r} needs the run's epochs")
            share = float(self.warmup[:-1]) / 100 * self.epochs
            return min(math.ceil(share - 1e-9), self.epochs - 1)
        return self.warmup

    @property
    def share_in_steps(self) -> float:
        """``P%`` of a 1-epoch run, which no whole epoch matches: that share of its steps."""
        if self.epochs == 1 and isinstance(self.warmup, str) and self.warmup.endswith("%") \
                and not self.warmup_steps:
            return float(self.warmup[:-1]) / 100
        return 0.0

    @property
    def in_steps(self) -> bool:
        """Whether the switch point is a step (mid-epoch), not an epoch start."""
        return bool(self.warmup_steps or self.share_in_steps)

    def switch_step(self, steps_per_epoch: int | None = None) -> int | None:
        """The global optimizer step the switch is before (None: automatic, not yet decided).

        Needs ``steps_per_epoch`` for the epoch forms, fractions and DiLoCo."""
        if not self.in_steps:
            epoch = self.switch_epoch
            return None if epoch == "auto" or steps_per_epoch is None else int(epoch) * steps_per_epoch
        w = self.warmup_steps or self.share_in_steps
        if w < 1 and not (steps_per_epoch and self.epochs):
            raise ValueError(f"a switch after {w:g} of the run needs its epochs and steps per epoch")
        at = int(w) if w >= 1 else max(1, round(w * self.epochs * steps_per_epoch))
        if self.inner_steps and steps_per_epoch:  # DiLoCo: the next synchronized step
            h = self.inner_steps
            at = min(-(-at // h) * h, -(-at // steps_per_epoch) * steps_per_epoch)
        return at

    def due_at_epoch(self, epoch: int) -> bool:
        """A fixed switch at the start of ``epoch`` (the automatic one: the detector's)."""
        return not self.in_steps and not self.auto and epoch >= int(self.switch_epoch)

    def due_at_step(self, global_step: int, steps_per_epoch: int | None = None) -> bool:
        """A switch in steps before ``global_step``."""
        at = self.switch_step(steps_per_epoch) if self.in_steps else None
        return at is not None and global_step >= at

    # --- auto ---------------------------------------------------------------------------------

    @property
    def latest_auto_epoch(self) -> float | None:
        """The latest automatic switch any run of this schedule may have: ``max_warmup``, or
        half the run where ``epochs`` is known (the bound of :meth:`auto_cap`), else None."""
        if self.max_warmup is not None:
            return self.max_warmup
        if self.epochs is None:
            return None
        return min(max(self.min_warmup, self.epochs // 2), max(0, self.epochs - 1))

    def auto_cap(self, steps_per_epoch: int) -> float | None:
        """The latest automatic switch epoch with ``steps_per_epoch`` steps: ``max_warmup``, else
        the first epoch after both a tenth of the run and ``CAP_MIN_STEPS`` steps, within
        :attr:`latest_auto_epoch`. At a constant LR the stable ranks keep falling ~10% an epoch
        until the first decay, so the cap decides most switches (docs/benchmarks.md, "auto")."""
        if self.max_warmup is not None or self.epochs is None:
            return self.max_warmup
        want = max(self.min_warmup, math.ceil(CAP_FRACTION * self.epochs - 1e-9),
                   math.ceil(CAP_MIN_STEPS / max(1, steps_per_epoch)))
        return min(want, self.latest_auto_epoch)

    def observe_every(self, steps_per_epoch: int) -> int:
        """Steps between observations of the stable ranks (``observe_every_steps``, or 4 an
        epoch): the plateau window, in epochs, then holds several even in short runs."""
        return self.observe_every_steps or max(1, steps_per_epoch // OBSERVATIONS_PER_EPOCH)

    # --- after the switch ---------------------------------------------------------------------

    @property
    def carry(self) -> str:
        """What the optimizer carries: ``reset`` or ``project`` (``auto``: ``reset``)."""
        return "reset" if self.momentum == "auto" else self.momentum

    def rewarm(self, switch_step: int, steps_per_epoch: int) -> float:
        """The LR re-warm-up after a switch before ``switch_step``: ``lr_rewarm``, or under
        ``momentum="auto"`` with AdamW :data:`AUTO_REWARM` when the switch is past the LR warm-up
        (inside it the schedule still ramps: a second ramp only slows the run, measured)."""
        if (self.lr_rewarm or self.momentum != "auto" or not self.adamw
                or switch_step < round(self.lr_warmup_epochs * steps_per_epoch)):
            return self.lr_rewarm
        return AUTO_REWARM

    def lr_scale(self, global_step: int, switch_step: int, steps_per_epoch: int) -> float:
        """The factor on the LR at ``global_step`` after a switch before ``switch_step``: from
        1/W back to 1 over W steps, as ReLoRA after each reset (1.0 without a re-warm-up)."""
        ramp = self.rewarm(switch_step, steps_per_epoch)
        if ramp <= 0:
            return 1.0
        total = (self.epochs or 1) * steps_per_epoch
        width = max(1, round(ramp * total) if ramp < 1 else int(ramp))
        since = global_step - switch_step
        return 1.0 if since >= width else (max(0, since) + 1) / width

    def describe(self, steps_per_epoch: int) -> str | None:
        """What ``P%`` comes to in this run, said at its start (None for the other forms)."""
        if not (isinstance(self.warmup, str) and self.warmup.endswith("%")) or self.warmup_steps:
            return None
        if self.share_in_steps:
            return (f"warm-up: {self.warmup} of 1 epoch is no whole epoch: full rank for the first "
                    f"{self.switch_step(steps_per_epoch)} of its {steps_per_epoch} optimizer "
                    "steps, then the switch (mid-epoch)")
        n, epochs = int(self.switch_epoch), self.epochs or 0
        return (f"warm-up: {self.warmup} of {epochs} epoch{'s' * (epochs != 1)} = {n} full-rank "
                f"epoch{'s' * (n != 1)} before the switch")


def _parse_warmup(value: str | int) -> int | str:
    """A configuration's ``warmup_epochs`` string: ``"auto"`` and ``"P%"`` as they are, N an int."""
    text = str(value)
    return text if text == "auto" or text.endswith("%") else int(text)


# ---------------------------------------------------------------------------------------------
# What the optimizer carries
# ---------------------------------------------------------------------------------------------

def carry_state(state: Mapping[torch.Tensor, Mapping[str, Any]],
                before: Mapping[str, torch.Tensor], model: nn.Module, how: str
                ) -> dict[torch.Tensor, dict[str, Any]]:
    """The optimizer state every parameter of the switched ``model`` starts with.

    ``state``: the optimizer's before the switch (keyed by tensor); ``before``: the model's named
    parameters then. ``how`` ``"reset"``/``"auto"``: ``{}``, every parameter, surviving or new,
    starts empty (what ``pufferfish train`` measured, docs/benchmarks.md). ``"project"``: each
    surviving parameter's state (copied), and each factor's projected from its dense weight. The
    caller installs exactly this mapping, replacing whatever state its optimizer held.
    """
    if how not in SWITCH_STATE:
        raise ValueError(f"switch_momentum {how!r} is invalid: allowed {', '.join(SWITCH_STATE)}")
    if how != "project":
        return {}
    carried = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in state[p].items()}
               for p in model.parameters() if p in state}
    carried.update(projected_state(state, before, model))
    return carried


def install_state(optimizer: torch.optim.Optimizer, model: nn.Module,
                  carried: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
    """Make ``carried`` the state of ``model``'s parameters in ``optimizer``: each has exactly
    its carried entry, or none (state of parameters outside ``model`` is left alone)."""
    for p in model.parameters():
        optimizer.state.pop(p, None)
        if p in carried:
            optimizer.state[p] = dict(carried[p])


# How each optimizer-state entry of a dense weight carries onto the factors that replace it
# (switch_momentum "project"): an entry linear in the gradient (SGD's momentum, Adam's first
# moment) by the chain rule; Adam's second moment, an average of squared gradients, through the
# squared factors; a step count is copied, so Adam's bias correction matches the carried moments.
LINEAR_STATE = ("momentum_buffer", "exp_avg")
SQUARED_STATE = ("exp_avg_sq",)


def projected_state(state: Mapping[torch.Tensor, Mapping[str, Any]],
                    before: Mapping[str, torch.Tensor], model: nn.Module
                    ) -> dict[torch.Tensor, dict[str, Any]]:
    """The optimizer state of each new low-rank parameter of ``model``, from ``state`` (an
    optimizer's) of the dense parameters it replaced (``before``: the named parameters before
    the switch), by :meth:`LowRankModule.project_dense_state`.

    For ``W = L R`` with gradient ``G``: ``L`` gets ``G Rᵀ``, ``R`` gets ``Lᵀ G`` (momentum,
    ``exp_avg``); ``exp_avg_sq`` ``V`` of ``W`` becomes ``V (R∘R)ᵀ`` and ``(L∘L)ᵀ V``, the
    expected squared factor gradient if the entries of ``G`` are uncorrelated; ``step`` is the
    dense weight's. A parameter gets state only if every entry the dense state had could be
    carried (else it starts empty, as after a reset).
    """
    alive = {id(p) for p in model.parameters()}
    projected: dict[torch.Tensor, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LowRankModule):
            continue
        prefix = f"{name}." if name else ""
        dense = {n[len(prefix):]: state[t] for n, t in before.items()
                 if n.startswith(prefix) and id(t) not in alive and t in state}
        if dense:
            projected.update(_project_module(module, dense))
    return projected


def _project_module(module: LowRankModule, dense: Mapping[str, Mapping[str, Any]]
                    ) -> dict[torch.Tensor, dict[str, Any]]:
    """One low-rank module's share of :func:`projected_state` (``dense``: its replaced
    parameters' state by their name within the module)."""
    keys = {k for st in dense.values() for k in st}
    carried: dict[str, dict[str, Any]] = {}
    for key in keys & {*LINEAR_STATE, *SQUARED_STATE}:
        tensors = {n: st[key] for n, st in dense.items() if isinstance(st.get(key), torch.Tensor)}
        source = _squared(module) if key in SQUARED_STATE else module
        for n, value in source.project_dense_state(tensors).items():
            carried.setdefault(n, {})[key] = value
    steps = [st["step"] for st in dense.values() if "step" in st]
    projected: dict[torch.Tensor, dict[str, Any]] = {}
    for n, entry in carried.items():
        if steps:
            entry["step"] = steps[0].clone() if isinstance(steps[0], torch.Tensor) else steps[0]
        if set(entry) >= keys:
            projected[module.get_parameter(n)] = entry
    return projected


def projected_momentum(state: Mapping[torch.Tensor, Mapping[str, Any]],
                       before: Mapping[str, torch.Tensor], model: nn.Module
                       ) -> dict[torch.Tensor, torch.Tensor]:
    """The SGD momentum buffer of each new low-rank parameter (see :func:`projected_state`)."""
    return {p: st["momentum_buffer"] for p, st in projected_state(state, before, model).items()
            if "momentum_buffer" in st}


def _squared(module: LowRankModule) -> LowRankModule:
    """A copy of ``module`` whose parameters are squared elementwise (the factor pairs are
    reshapes of parameters, so its pairs are the squared factors)."""
    ghost = copy.deepcopy(module)
    with torch.no_grad():
        for p in ghost.parameters():
            p.mul_(p)
    return ghost
