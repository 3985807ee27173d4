"""The switch from full rank to low rank, and its one owner.

Every rule of *when* (in optimizer steps) and of what the optimizer carries across the switch is
in :mod:`pufferfish.switch.schedule` (:class:`SwitchSchedule`, :func:`carry_state`); its module
docstring is the short answer. Two classes, one :class:`Switch` that composes them and holds
their state:

- :class:`SwitchPolicy`, *when*: the schedule's fixed point, or (``"auto"``) when every layer's
  stable rank has settled (:class:`~pufferfish.auto.SwitchDetector`, fed by a
  :class:`~pufferfish.auto.StableRankTracker`);
- :class:`FactorizationPlan`, *how*: the ranks (a ratio, or chosen from the stable ranks), the
  layers kept full-rank (patterns, preset, first K, or profiled), extra BatchNorm, the LSTM kernel,
  and the record of what it decided (the factorized ranks and kernels rebuild the architecture on
  resume).

The switch changes the model only. What depends on its parameters belongs to whoever built it:
:class:`~pufferfish.Recipe` edits a hand-written loop's optimizer and re-wraps its DDP,
:class:`~pufferfish.method.PufferfishMethod` lets the training loop rebuild its own; both give
the optimizer the state :func:`carry_state` says. Every
data-dependent decision is rank 0's, broadcast, so replicas cannot diverge.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..auto import (
    StableRankTracker,
    SwitchDetector,
    budget_params,
    choose_ranks,
    profile_keep,
    time_kernels,
)
from ..distributed import fsdp
from ..distributed.env import broadcast_in_place, broadcast_object, unwrapped
from ..lowrank import FactorizationReport, LowRankModule, factorize
from ..lowrank.base import low_rank_class_for_type
from ..lowrank.factorize import factorizable_modules
from ..lowrank.presets import resolve_preset
from ..lowrank.report import format_table
from .schedule import (
    SwitchSchedule,
    carry_state,
    install_state,
    projected_momentum,
    projected_state,
)

__all__ = ["FactorizationPlan", "Switch", "SwitchPolicy", "SwitchSchedule", "carry_state",
           "install_state", "projected_momentum", "projected_state"]


class SwitchPolicy:
    """When to switch: the :class:`SwitchSchedule`'s rule, and for ``"auto"`` the detector that
    says when the ranks settle (between the schedule's ``min_warmup`` and its cap).

    The stable-rank record (tracker) and the detector exist only for automatic choices (an
    automatic switch, or automatic ranks, which are chosen from the same record).
    """

    def __init__(self, schedule: SwitchSchedule, track: bool = False, threshold: float = 0.05,
                 window: float = 1.0) -> None:
        self.schedule = schedule
        self.switched_at: int | None = None
        self.tracker: Any = None
        self.detector: Any = None
        self.latest: tuple[float, dict[str, float]] | None = None  # the last observation
        self._decided: dict[int, bool] = {}  # epoch -> the agreed answer of should_switch
        if schedule.auto or track:
            self.detector = SwitchDetector(window=window, threshold=threshold,
                                           min_epochs=schedule.min_warmup,
                                           max_epochs=schedule.latest_auto_epoch)

    @property
    def warmup_epochs(self) -> int | str:
        """The epoch the switch is before, or ``"auto"`` (the schedule's)."""
        return self.schedule.switch_epoch

    @property
    def switched(self) -> bool:
        return self.switched_at is not None

    def observe(self, t: float, model: nn.Module, keep: list[str]) -> dict[str, float]:
        """Stable ranks of the layers not in ``keep`` after ``t`` epochs (automatic only, else
        ``{}``); the first call records them at initialization. Cached per ``t``."""
        if self.detector is None or self.switched:
            return {}
        if self.latest is not None and self.latest[0] == t:
            return self.latest[1]
        if self.tracker is None:
            self.tracker = StableRankTracker(model, keep=keep)
        values = self.tracker.observe(t)
        self.detector.update(t, values)
        self.latest = (t, values)
        return values

    def due(self, epoch: int, model: nn.Module, keep: list[str]) -> bool:
        """Whether to switch at the start of ``epoch``; the same answer on every rank."""
        if self.switched or self.schedule.in_steps:
            return False
        if not self.schedule.auto:
            return self.schedule.due_at_epoch(epoch)
        if epoch not in self._decided:  # one agreement per epoch
            self.observe(epoch, model, keep)
            self._decided[epoch] = bool(broadcast_object(self.detector.switched_at is not None))
        return self._decided[epoch]

    def decisions(self, epoch: int) -> dict[str, Any]:
        """What decided a switch at ``epoch`` (for the plan's record)."""
        decisions: dict[str, Any] = {}
        if self.schedule.auto:
            d = self.detector
            decisions["switch"] = {
                "epoch": epoch, "fired_at": d.switched_at, "reason": d.reason,
                "threshold": d.threshold, "window": d.window, "max_epochs": d.max_epochs,
                "change_per_epoch": {n: d.smoothed_change(n) for n in d.values}}
        if self.tracker is not None:
            decisions["stable_ranks"] = {"initial": dict(self.tracker.initial),
                                         "history": dict(self.tracker.history)}
        return decisions

    def unsettled(self) -> list[str]:
        """The tracked layers whose stable rank still moved (by at least the detector's
        threshold per epoch) at the last observation: their ranks are not read from it."""
        d = self.detector
        if d is None:
            return []
        return [n for n in d.values if not d.smoothed_change(n) < d.threshold]

    def describe(self) -> list[str]:
        if not self.schedule.auto or not self.switched:
            return []
        d = self.detector
        why = (f"reached the cap max_warmup={d.max_epochs:g} before every stable rank settled"
               if d.reason != "settled" else
               f"every stable rank changed < {d.threshold:g}/epoch over {d.window:g} "
               f"epoch(s) at epoch {d.switched_at:.2f}")
        return [f"switch epoch (auto): {self.switched_at} ({why})"]

    def cap(self, steps_per_epoch: int) -> None:
        """Set the latest automatic switch epoch once the run knows its steps per epoch (the
        schedule's :meth:`~SwitchSchedule.auto_cap`); kept in :meth:`state_dict`, so a resumed
        run keeps the same cap."""
        latest = self.schedule.auto_cap(steps_per_epoch)
        if self.detector is not None and latest is not None:
            if latest < self.detector.min_epochs:
                raise ValueError(f"latest switch epoch {latest} is below the earliest "
                                 f"{self.detector.min_epochs}")
            self.detector.max_epochs = latest

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"switched_at": self.switched_at}
        if self.detector is not None:
            state["max_epochs"] = self.detector.max_epochs
        if self.tracker is not None:
            state["initial"] = dict(self.tracker.initial)
            state["history"] = {k: [list(p) for p in v] for k, v in self.tracker.history.items()}
        return state

    def load_state_dict(self, state: dict[str, Any], model: nn.Module, keep: list[str]) -> None:
        """Restore :meth:`state_dict`; before the switch, replay the detector over the record so
        that it decides as it would have without the interruption."""
        self.switched_at = state.get("switched_at")
        if self.detector is not None and state.get("max_epochs") is not None:
            self.detector.max_epochs = state["max_epochs"]
        if "initial" not in state or self.switched:
            return
        d = self.detector  # forget what this process observed before the load (its step 0)
        self.detector = SwitchDetector(window=d.window, threshold=d.threshold,
                                       min_epochs=d.min_epochs, max_epochs=d.max_epochs)
        self.tracker = StableRankTracker(model, keep=keep)
        self.tracker.initial = dict(state["initial"])
        self.tracker.history = {k: [tuple(p) for p in v] for k, v in state["history"].items()}
        times = sorted({t for points in self.tracker.history.values() for t, _ in points})
        for t in times:
            values = {k: v for k, points in self.tracker.history.items() for tt, v in points
                      if tt == t}
            self.detector.update(t, values)
            self.latest = (t, values)


class FactorizationPlan:
    """How to factorize: ranks, full-rank layers, options; and the record of what it did.

    ``rank_ratio``/``keep`` may be ``"auto"`` (see :class:`~pufferfish.Recipe` for every
    argument). :meth:`apply` factorizes and records the ranks and LSTM kernels it chose;
    :meth:`rebuild` rebuilds exactly that architecture on a fresh model (resume).
    """

    def __init__(self, rank_ratio: float | str = 0.25, keep: Iterable[str] | str = (),
                 max_rank_ratio: float | None = 0.25, preset: str | None = None,
                 keep_first: int = 0, extra_bn: bool = False, example_input: Any = None,
                 kernel: str = "auto", amp_dtype: torch.dtype | None = None) -> None:
        self.rank_ratio = rank_ratio
        self.max_rank_ratio = max_rank_ratio
        self.keep_auto = keep == "auto"
        self.keep = [] if keep == "auto" else ([keep] if isinstance(keep, str) else list(keep))
        self.preset = preset
        self.keep_first = keep_first
        self.extra_bn = extra_bn
        self.example_input = example_input
        self.kernel = kernel  # "auto": timed at the switch; a name: that kernel, reproducibly
        self.amp_dtype = amp_dtype  # the run's autocast: each timed forward runs under it
        self.report: FactorizationReport | None = None
        self.decisions: dict[str, Any] = {}  # what the automatic choices measured and chose
        self.ranks: dict[str, int] = {}  # factorized module -> rank
        self.kernels: dict[str, str] = {}  # layer with several kernels -> the one it runs

    def check(self, model: nn.Module) -> None:
        """The keep patterns and preset fit ``model``: ``factorize`` on a plan that replaces
        nothing (``include=[]``), so that a typo fails now with its message, not at the switch."""
        with warnings.catch_warnings():  # "changed nothing" is this dry run's purpose
            warnings.simplefilter("ignore", UserWarning)
            factorize(model, keep=list(self.keep), preset=self.preset,
                      keep_first=self.keep_first, include=[])

    def static_keep(self, model: nn.Module) -> list[str]:
        """The patterns kept full-rank before any measurement: ``keep`` and the preset's."""
        return list(self.keep) + resolve_preset(model, self.preset).get("keep", [])

    def factorize_kwargs(self, model: nn.Module, tracker: Any = None,
                         unsettled: Iterable[str] = ()) -> dict[str, Any]:
        """The arguments of :func:`pufferfish.factorize` for ``model`` (automatic choices made
        now, from ``tracker``'s stable ranks and by profiling, rank 0's for all; ``unsettled``
        layers get the budget's rank, see :func:`~pufferfish.auto.choose_ranks`)."""
        kwargs: dict[str, Any] = dict(keep=list(self.keep), preset=self.preset,
                                      keep_first=self.keep_first, extra_bn=self.extra_bn,
                                      example_input=self.example_input)
        if self.rank_ratio == "auto":
            if tracker is None:
                raise ValueError("rank_ratio='auto' needs the stable ranks at initialization: "
                                 "call observe(0, model) (or on_epoch_start) before training")
            ranks = broadcast_object(choose_ranks(tracker, keep=self.static_keep(model),
                                                  max_ratio=self.max_rank_ratio,
                                                  unsettled=unsettled))
            self.decisions["ranks"] = ranks
            self.decisions["unsettled"] = broadcast_object(sorted(set(unsettled) & set(ranks)))
            kwargs["overrides"] = ranks
            kwargs["rank_ratio"] = 1.0  # unused: every candidate has an override
        else:
            kwargs["rank_ratio"] = float(self.rank_ratio)
        if self.keep_auto:
            kwargs["keep"] += self._profiled_keep(model, kwargs)
        return kwargs

    def _profiled_keep(self, model: nn.Module, kwargs: dict[str, Any]) -> list[str]:
        """``keep="auto"``: the layers that factorizing does not make faster (within budget)."""
        static = self.static_keep(model)
        ranks = kwargs.get("overrides") or {
            name: kwargs["rank_ratio"] for name in factorizable_modules(model)}
        ranks = {n: r for n, r in ranks.items()
                 if not any(fnmatch.fnmatchcase(n, p) for p in static)}
        budget = (budget_params(model, self.max_rank_ratio, keep=static)
                  if self.rank_ratio == "auto" and self.max_rank_ratio is not None else None)
        keep, measured = profile_keep(model, self.example_input, ranks, extra_bn=self.extra_bn,
                                      max_params=budget, amp_dtype=self.amp_dtype)
        keep = broadcast_object(keep)  # timings differ across ranks: rank 0 decides for all
        self.decisions["keep_auto"] = {"keep": keep, "measurements": broadcast_object(measured)}
        return keep

    def apply(self, model: nn.Module, tracker: Any = None,
              unsettled: Iterable[str] = ()) -> FactorizationReport:
        """Factorize ``model`` in place, choose the kernel of each layer that has several, record
        both."""
        sharded = fsdp.is_sharded(model)
        if sharded and (self.rank_ratio == "auto" or self.keep_auto):
            raise ValueError("rank_ratio/keep 'auto' are invalid on a fully_shard-ed model (they "
                             "read every layer's dense weights at once): allowed fixed values")
        kwargs = self.factorize_kwargs(model, tracker, unsettled)
        if sharded:  # dense weights gathered one layer at a time
            kwargs["materialize"] = fsdp.gathered
            fsdp.unwrap_layers(model, lambda kind: low_rank_class_for_type(kind) is not None)
        with warnings.catch_warnings():
            if sharded:  # FSDP2's own state-dict hooks stay with the module they served
                warnings.filterwarnings("ignore", message="the state_dict hooks of")
            self.report = factorize(model, **kwargs)
        if sharded:  # each rank factorized its own gathered copy, and an SVD need not give
            # the same bits on every rank (GPUs): all take rank 0's factors before they are
            # sharded (a DDP wrapper's construction broadcasts them; nothing else is assumed
            # replicated: pipeline stages and ensembles keep their own)
            factors = {id(p): p for m in model.modules() if isinstance(m, LowRankModule)
                       for p in m.parameters() if not fsdp.is_dtensor(p)}
            broadcast_in_place(factors.values())
        if self.kernel != "auto":
            self._fix_kernels(model)
        elif self.example_input is not None:
            self._choose_kernels(model)
        self.ranks = self.report.ranks
        self.kernels = {n: m.current_kernel() for n, m in model.named_modules()
                        if isinstance(m, LowRankModule) and m.current_kernel() is not None}
        return self.report

    def _choose_kernels(self, model: nn.Module) -> None:
        """Same function, device- and size-dependent cost: run each layer's fastest kernel (rank
        0's timing, so that every replica runs the same one)."""
        kernels = broadcast_object(time_kernels(model, self.example_input,
                                                amp_dtype=self.amp_dtype))
        for name, k in kernels.items():
            model.get_submodule(name).use_kernel(k["kernel"])
        if kernels:
            self.decisions["kernels"] = kernels

    def _fix_kernels(self, model: nn.Module) -> None:
        """``kernel`` given: every layer that has it runs it. Timing can pick differently from
        run to run on a loaded machine (the kernels round differently), so a fixed kernel is how
        two runs, or a run and its resumption before the switch, stay bitwise equal."""
        for module in model.modules():
            if isinstance(module, LowRankModule) and self.kernel in module.kernel_options():
                module.use_kernel(self.kernel)

    def rebuild(self, model: nn.Module) -> None:
        """Factorize ``model`` (fresh, dense) into the recorded architecture: ranks and kernels."""
        if self.ranks:
            factorize(model, include=list(self.ranks), overrides=self.ranks, rank_ratio=1.0,
                      extra_bn=self.extra_bn)
        for name, kernel in self.kernels.items():
            model.get_submodule(name).use_kernel(kernel)

    def describe(self, tracker: Any = None,
                 latest: tuple[float, dict[str, float]] | None = None) -> list[str]:
        """The automatic choices as text lines, for the factorization report."""
        lines: list[str] = []
        ranks = self.decisions.get("ranks")
        if ranks and tracker is not None:
            now = latest[1] if latest is not None else {}
            budget = "none" if self.max_rank_ratio is None else f"{self.max_rank_ratio:g} of full"
            lines.append(f"ranks (auto, Cuttlefish rule, budget {budget}; a stable rank still "
                         "moving at the switch is not read: that layer gets the budget's rank):")
            unsettled = set(self.decisions.get("unsettled", ()))
            rows = [("module", "stable rank at init", "now", "rank", "from")]
            rows += [(n, f"{tracker.initial.get(n, float('nan')):.2f}",
                      f"{now.get(n, float('nan')):.2f}", str(r),
                      "budget (unsettled)" if n in unsettled else "stable rank")
                     for n, r in ranks.items()]
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
        for name, k in (self.decisions.get("kernels") or {}).items():
            times = ", ".join(f"{key[:-3]} {ms:.3f} ms" for key, ms in k.items()
                              if key.endswith("_ms"))
            lines.append(f"kernel of {name} (forward+backward on this run's shapes): {times} "
                         f"-> {k['kernel']}")
        return lines

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": dict(self.ranks), "kernels": dict(self.kernels)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ranks = dict(state.get("ranks", {}))
        self.kernels = dict(state.get("kernels", {}))


class Switch:
    """The one owner of the switch: a :class:`SwitchPolicy` and a :class:`FactorizationPlan`.

    Works on the unwrapped model (the callers unwrap DDP); its :meth:`state_dict` is all a
    checkpoint needs to decide the same way and rebuild the same architecture.
    """

    def __init__(self, policy: SwitchPolicy, plan: FactorizationPlan) -> None:
        self.policy = policy
        self.plan = plan
        self._checked = False

    @property
    def switched(self) -> bool:
        return self.policy.switched

    def check(self, model: nn.Module) -> None:
        """Once, before the switch: the plan's patterns and preset fit ``model``."""
        if self._checked or self.switched:
            return
        self.plan.check(model)
        self._checked = True

    def observe(self, t: float, model: nn.Module) -> dict[str, float]:
        self.check(model)
        if self.policy.detector is not None and fsdp.is_sharded(unwrapped(model)):
            raise ValueError("automatic choices (warmup_epochs/rank_ratio 'auto') are invalid on "
                             "a fully_shard-ed model (the stable ranks read every layer's dense "
                             "weights): allowed fixed values")
        return self.policy.observe(t, model, self.plan.static_keep(model))

    def due(self, epoch: int, model: nn.Module) -> bool:
        self.check(model)
        return self.policy.due(epoch, model, self.plan.static_keep(model))

    def switch(self, epoch: int, model: nn.Module) -> FactorizationReport:
        """Factorize ``model`` in place at the start of ``epoch``; the report."""
        self.check(model)
        self.plan.decisions.update(self.policy.decisions(epoch))
        report = self.plan.apply(model, self.policy.tracker, self.policy.unsettled())
        self.policy.switched_at = epoch
        return report

    def describe(self) -> str:
        """The automatic choices of the switch as text (empty for fixed choices)."""
        lines = self.policy.describe()
        lines += self.plan.describe(self.policy.tracker, self.policy.latest)
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: switch epoch, stable-rank record, factorized ranks and kernels."""
        return {**self.policy.state_dict(), **self.plan.state_dict()}

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Restore the records (the architecture itself: :meth:`FactorizationPlan.rebuild`)."""
        self.plan.load_state_dict(state)
        inner = unwrapped(model)
        self.policy.load_state_dict(state, inner, self.plan.static_keep(inner))


