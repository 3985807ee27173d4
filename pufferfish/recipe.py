"""The Pufferfish schedule: full-rank warm-up, then one switch to the factorized model.

The switch is the method's single moment of surgery, and it lives in :meth:`Recipe.switch`:

1. factorize the (unwrapped) model in place, identically on every rank (same weights, same plan);
2. build a new optimizer of the same class and hyper-parameters over the new parameters. Momentum
   and other optimizer state are *reset*, as in the paper: the old buffers belong to dense weights
   that no longer exist, and projecting them onto the factors is not worth its complexity;
3. continue the LR schedule where it was: a scheduler is re-pointed at the new optimizer, keeping
   its step count (the training loop of this package computes the LR from the step instead);
4. re-wrap in DDP (whose constructor broadcasts rank 0's parameters, so replicas are identical)
   and call ``on_wrap`` to re-register the communication hook with fresh state.

Use it from your own loop::

    recipe = pufferfish.Recipe(warmup_epochs=2, rank_ratio=0.25, preset="paper")
    for epoch in range(epochs):
        model, optimizer, scheduler = recipe.on_epoch_start(epoch, model, optimizer, scheduler)
        train_one_epoch(model, optimizer, scheduler)

``warmup_epochs="auto"`` switches when every layer's stable rank has settled, ``rank_ratio="auto"``
picks per-layer ranks from the stable ranks, ``keep="auto"`` profiles each layer and keeps those
that factorizing does not make cheaper (see :mod:`pufferfish.auto`). With ``warmup_epochs="auto"``,
also call ``recipe.observe(epoch + step / steps, model)`` a few times per epoch (the CLI does, 4
times): the plateau test is a change per epoch over a 1-epoch window, and observations within it
average out noise and catch a rank that moves and comes back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .lowrank import FactorizationReport, factorize
from .lowrank.factorize import format_table

__all__ = ["Recipe", "rebuild_optimizer"]

ParamGroupsFn = Callable[[nn.Module], Sequence[dict[str, Any]]]


class Recipe:
    """When and how a model is switched from full-rank to low-rank.

    Args:
        warmup_epochs: full-rank epochs before the switch (the paper: about 10% of training);
            0 factorizes at the start of epoch 0 (spectral initialization of a low-rank model);
            ``"auto"``: when every tracked layer's stable rank has stopped changing.
        rank_ratio: rank as a fraction of each layer's full rank (paper: 1/4), or ``"auto"``.
        max_rank_ratio: with ``rank_ratio="auto"``, no layer's rank exceeds this fraction of its
            full rank (default 1/4: never larger than the paper's preset); None: no budget.
        keep: glob patterns of layers kept full-rank, or ``"auto"`` (profile; preset still applies).
        preset: the model's named preset of full-rank layers (``"paper"``), or None.
        keep_first: also keep the first K factorizable layers full-rank (hybrid network).
        extra_bn: BatchNorm between the factors of each conv.
        example_input: a batch for the forward-order trace, MAC counts and ``keep="auto"``.
        param_groups: builds the new optimizer's parameter groups from the factorized model
            (default: one group with every parameter).
        on_wrap: called with each new DDP wrapper, e.g. to register a comm hook.
        min_warmup, max_warmup: bounds of the automatic switch epoch.
        switch_threshold, switch_window: the automatic switch's plateau test, see
            :class:`~pufferfish.auto.SwitchDetector` (change per epoch, window in epochs).
    """

    def __init__(
        self,
        warmup_epochs: int | str = 2,
        rank_ratio: float | str = 0.25,
        keep: Iterable[str] | str = (),
        max_rank_ratio: float | None = 0.25,
        preset: str | None = None,
        keep_first: int = 0,
        extra_bn: bool = False,
        example_input: Any = None,
        param_groups: ParamGroupsFn | None = None,
        on_wrap: Callable[[DistributedDataParallel], Any] | None = None,
        min_warmup: int = 1,
        max_warmup: int | None = None,
        switch_threshold: float = 0.05,
        switch_window: float = 1.0,
    ) -> None:
        if warmup_epochs != "auto" and (isinstance(warmup_epochs, bool) or not isinstance(
                warmup_epochs, int) or warmup_epochs < 0):
            raise ValueError(f"warmup_epochs {warmup_epochs!r} is invalid: allowed an integer >= 0 "
                             "or 'auto'")
        self.warmup_epochs = warmup_epochs
        self.rank_ratio = rank_ratio
        self.max_rank_ratio = max_rank_ratio
        self.keep_auto = keep == "auto"
        self.keep = [] if keep == "auto" else ([keep] if isinstance(keep, str) else list(keep))
        self.preset = preset
        self.keep_first = keep_first
        self.extra_bn = extra_bn
        self.example_input = example_input
        self.param_groups = param_groups
        self.on_wrap = on_wrap
        self.switched_at: int | None = None
        self.report: FactorizationReport | None = None
        self.decisions: dict[str, Any] = {}  # what the automatic choices measured and chose
        self.tracker: Any = None
        self.detector: Any = None
        self._latest: tuple[float, dict[str, float]] | None = None
        self._decided: dict[int, bool] = {}
        if warmup_epochs == "auto" or rank_ratio == "auto":
            from .auto import SwitchDetector

            self.detector = SwitchDetector(window=switch_window, threshold=switch_threshold,
                                           min_epochs=min_warmup, max_epochs=max_warmup)

    @property
    def switched(self) -> bool:
        return self.switched_at is not None

    def observe(self, t: float, model: nn.Module) -> dict[str, float]:
        """Stable ranks of the full-rank layers after ``t`` epochs; feeds the switch detector.

        For automatic choices only (else ``{}``). ``t`` may be fractional (``epoch + step /
        steps``): observing a few times per epoch lets the detector see a whole window in short
        runs. The first call records the stable ranks at initialization (Cuttlefish's reference):
        make it before training, as :meth:`on_epoch_start` does at epoch 0. Cached per ``t``.
        """
        if self.detector is None or self.switched:
            return {}
        if self._latest is not None and self._latest[0] == t:
            return self._latest[1]
        from .auto import StableRankTracker

        if self.tracker is None:
            self.tracker = StableRankTracker(_unwrap(model), keep=self._static_keep(model))
        values = self.tracker.observe(t)
        self.detector.update(t, values)
        self._latest = (t, values)
        return values

    def should_switch(self, epoch: int, model: nn.Module) -> bool:
        """Whether to factorize at the start of ``epoch``; the same answer on every rank.

        With ``warmup_epochs="auto"``: at the first epoch boundary at or after the detector fired
        (it may fire between boundaries when observed every N steps).
        """
        if self.switched:
            return False
        if self.warmup_epochs != "auto":
            return epoch >= self.warmup_epochs
        if epoch not in self._decided:  # one agreement per epoch
            self.observe(epoch, model)
            self._decided[epoch] = bool(_agree(self.detector.switched_at is not None))
        return self._decided[epoch]

    def on_epoch_start(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        if self.should_switch(epoch, model):
            return self.switch(epoch, model, optimizer, scheduler)
        if self.detector is not None and epoch == 0:
            self.observe(0, model)
        return model, optimizer, scheduler

    def _static_keep(self, model: nn.Module) -> list[str]:
        keep = list(self.keep)
        if self.preset is not None:
            keep += (getattr(model, "PRESETS", {}) or {}).get(self.preset, {}).get("keep", [])
        return keep

    def factorize_kwargs(self, model: nn.Module) -> dict[str, Any]:
        """The arguments of :func:`pufferfish.factorize` this recipe uses for ``model``."""
        kwargs: dict[str, Any] = dict(keep=list(self.keep), preset=self.preset,
                                      keep_first=self.keep_first, extra_bn=self.extra_bn,
                                      example_input=self.example_input)
        if self.rank_ratio == "auto":
            from .auto import choose_ranks

            if self.tracker is None:
                raise ValueError("rank_ratio='auto' needs the stable ranks at initialization: "
                                 "call observe(0, model) (or on_epoch_start) before training")
            ranks = _agree(choose_ranks(self.tracker, keep=self._static_keep(model),
                                        max_ratio=self.max_rank_ratio))
            self.decisions["ranks"] = ranks
            kwargs["overrides"] = ranks
            kwargs["rank_ratio"] = 1.0  # unused: every candidate has an override
        else:
            kwargs["rank_ratio"] = float(self.rank_ratio)
        if self.keep_auto:
            from .auto import budget_params, profile_keep
            from .lowrank.factorize import factorizable_modules

            if self.example_input is None:
                raise ValueError("keep='auto' needs an example_input to profile the layers")
            static = self._static_keep(model)
            ranks = kwargs.get("overrides") or {
                name: kwargs["rank_ratio"] for name in factorizable_modules(model)}
            ranks = {n: r for n, r in ranks.items()
                     if not any(fnmatch.fnmatchcase(n, p) for p in static)}
            budget = (budget_params(model, self.max_rank_ratio, keep=static)
                      if self.rank_ratio == "auto" and self.max_rank_ratio is not None else None)
            keep, measured = profile_keep(model, self.example_input, ranks,
                                          extra_bn=self.extra_bn, max_params=budget)
            keep = _agree(keep)  # timings differ across ranks: rank 0 decides for all
            self.decisions["keep_auto"] = {"keep": keep, "measurements": _agree(measured)}
            kwargs["keep"] += keep
        return kwargs

    def describe_decisions(self) -> str:
        """The automatic choices of the last switch as text, for the factorization report."""
        lines: list[str] = []
        if self.warmup_epochs == "auto" and self.switched:
            d = self.detector
            why = (f"reached the cap max_warmup={d.max_epochs:g} before every stable rank settled"
                   if d.reason != "settled" else
                   f"every stable rank changed < {d.threshold:g}/epoch over {d.window:g} "
                   f"epoch(s) at epoch {d.switched_at:.2f}")
            lines.append(f"switch epoch (auto): {self.switched_at} ({why})")
        ranks = self.decisions.get("ranks")
        if ranks and self.tracker is not None:
            now = self._latest[1] if self._latest is not None else {}
            budget = "none" if self.max_rank_ratio is None else f"{self.max_rank_ratio:g} of full"
            lines.append(f"ranks (auto, Cuttlefish rule, budget {budget}):")
            rows = [("module", "stable rank at init", "now", "rank")]
            rows += [(n, f"{self.tracker.initial.get(n, float('nan')):.2f}",
                      f"{now.get(n, float('nan')):.2f}", str(r)) for n, r in ranks.items()]
            lines += format_table(rows, indent="  ")
        measured = (self.decisions.get("keep_auto") or {}).get("measurements")
        if measured:
            lines.append("full-rank layers (auto, forward+backward profile on this run's shapes):")
            rows = [("module", "rank", "dense ms", "low-rank ms", "speed-up", "param share",
                     "decision")]
            fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            rows += [(n, str(m.get("rank")), fmt(m.get("dense_ms"), ".3f"),
                      fmt(m.get("lowrank_ms"), ".3f"), fmt(m.get("speedup"), ".2f"),
                      fmt(m.get("param_saving_share"), ".2%"), str(m.get("decision")))
                     for n, m in measured.items()]
            lines += format_table(rows, indent="  ")
        for name, k in (self.decisions.get("lstm_kernels") or {}).items():
            lines.append(f"LSTM kernel of {name} (forward+backward on this run's shapes): fused "
                         f"{k['fused_ms']:.3f} ms, loop {k['loop_ms']:.3f} ms -> {k['kernel']}")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """Progress to checkpoint: switch epoch, and the stable-rank record of automatic runs."""
        state: dict[str, Any] = {"switched_at": self.switched_at}
        if self.tracker is not None:
            state["initial"] = dict(self.tracker.initial)
            state["history"] = {k: [list(p) for p in v] for k, v in self.tracker.history.items()}
        return state

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Restore :meth:`state_dict` (before the switch: ``model`` is still full-rank)."""
        self.switched_at = state.get("switched_at")
        if "initial" in state and not self.switched:
            from .auto import StableRankTracker

            self.tracker = StableRankTracker(_unwrap(model), keep=self._static_keep(model))
            self.tracker.initial = dict(state["initial"])
            self.tracker.history = {k: [tuple(p) for p in v] for k, v in state["history"].items()}
            # Replay the detector over the recorded history so that it decides as it would have.
            times = sorted({t for points in self.tracker.history.values() for t, _ in points})
            for t in times:
                values = {k: v for k, points in self.tracker.history.items()
                          for tt, v in points if tt == t}
                self.detector.update(t, values)
                self._latest = (t, values)

    def switch(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
        """Factorize ``model`` and rebuild what depends on its parameters (see module docs)."""
        inner = _unwrap(model)
        if self.warmup_epochs == "auto":
            d = self.detector
            self.decisions["switch"] = {
                "epoch": epoch, "fired_at": d.switched_at, "reason": d.reason,
                "threshold": d.threshold, "window": d.window, "max_epochs": d.max_epochs,
                "change_per_epoch": {n: d.smoothed_change(n) for n in d.values}}
        if self.tracker is not None:
            self.decisions["stable_ranks"] = {"initial": dict(self.tracker.initial),
                                              "history": dict(self.tracker.history)}
        self.report = factorize(inner, **self.factorize_kwargs(inner))
        if self.example_input is not None:
            from .auto import time_lstm_kernels

            # Same function, device- and size-dependent cost: run the faster kernel (rank 0's
            # timing, so that every replica runs the same one).
            kernels = _agree(time_lstm_kernels(inner, self.example_input))
            for name, k in kernels.items():
                inner.get_submodule(name).fused = k["kernel"] == "fused"
            if kernels:
                self.decisions["lstm_kernels"] = kernels
        self.switched_at = epoch
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, inner, self.param_groups)
            if scheduler is not None:
                scheduler.optimizer = optimizer
        if isinstance(model, DistributedDataParallel):
            model = DistributedDataParallel(inner, device_ids=model.device_ids,
                                            process_group=model.process_group)
            if self.on_wrap is not None:
                self.on_wrap(model)
        return model, optimizer, scheduler


def rebuild_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                      param_groups: ParamGroupsFn | None = None) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and settings over ``model``'s parameters.

    The current learning rate (and ``initial_lr``, which LR schedulers read) is carried over from
    the first group of the old optimizer; state such as momentum starts from zero.
    """
    groups = list(param_groups(model)) if param_groups else [{"params": list(model.parameters())}]
    new = type(optimizer)(groups, **optimizer.defaults)
    carried = {k: optimizer.param_groups[0][k] for k in ("lr", "initial_lr")
               if k in optimizer.param_groups[0]}
    for group in new.param_groups:
        group.update(carried)
    return new


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so that data-dependent decisions cannot diverge."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
