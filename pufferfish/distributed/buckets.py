"""DDP's gradient buckets: a fixed cap, torch's default, or one measured for the model trained.

DDP all-reduces a bucket as soon as every gradient in it is ready, so the bucket cap decides how
much of the communication overlaps the backward pass. torch's default (a 1 MiB first bucket, then
25 MiB) suits big models; a factorized ResNet-18 at width 0.25 (0.85 MB of gradients) falls into
one bucket, sent only after backward ends (docs/benchmarks.md). ``--bucket-mb`` is a cap in MiB
(DDP's unit; the first bucket gets the same cap), ``torch`` for torch's default, or ``auto``:
:class:`BucketTuner` times real training steps of the run with a few candidate caps on the real
process group and link, and keeps the fastest only if it is clearly faster than torch's default.

Latency needs no model here: every bucket is one collective (PowerSGD's three), so a link's round
trip is paid once per bucket inside the timed steps, and a high-latency link (``pufferfish bench
--bandwidth 100mbit@20ms``) makes the smaller caps, which mean more buckets, lose the trial by
what they really cost. The candidates are torch's default and the gradient size / 2, 4, 8, 16:
two buckets at the fewest, so no candidate sends a whole model in one collective.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .env import broadcast_object, rewrap_ddp

__all__ = ["AUTO", "TORCH", "BucketTuner", "bucket_overrides", "gradient_mib", "parse_bucket_mb"]

AUTO, TORCH = "auto", "torch"
MIB = 1024 * 1024
# The trial: each candidate is visited ROUNDS times (the order reversed in every other round, so
# that a drift of the machine's load favours no candidate), each visit one untimed step (DDP
# assigns buckets in its first step after a (re-)wrap) and TIMED_STEPS timed ones. A candidate
# wins only if its median step is THRESHOLD faster than torch's default's in every round.
FRACTIONS = (2, 4, 8, 16)  # candidate caps: the model's gradient bytes / these
ROUNDS, TIMED_STEPS, THRESHOLD = 2, 3, 0.10  # 5% let noise pick (docs/benchmarks.md)
EPOCH_SHARE = 4  # an epoch must have this many times the trial's steps to run one


def parse_bucket_mb(value: Any) -> str | float:
    """``"auto"``, ``"torch"`` or a cap in MiB > 0; ValueError naming the value and what is allowed."""
    if isinstance(value, str) and value.strip().lower() in (AUTO, TORCH):
        return value.strip().lower()
    try:
        cap = float(value)
    except (TypeError, ValueError):
        cap = math.nan
    if isinstance(value, bool) or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"bucket_mb {value!r} is invalid: allowed 'auto', 'torch' or a bucket "
                         "cap in MiB > 0 (e.g. 0.25)")
    return cap


def bucket_overrides(cap: float | None) -> dict[str, Any]:
    """DDP constructor arguments for ``cap`` MiB (None: torch's default buckets)."""
    return {"bucket_cap_mb": cap, "bucket_cap_mb_list": None}


def gradient_mib(model: nn.Module) -> float:
    """MiB of gradients DDP reduces for ``model`` (its trainable parameters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / MIB


def _label(cap: float | None) -> str:
    return TORCH if cap is None else f"{cap:.4g}"


class BucketTuner:
    """The bucket cap of a run's DDP wrapper, re-chosen whenever the model changes.

    :meth:`start` is called for each model (training's start, after the switch) and gives the cap
    to wrap it with; around every step :meth:`step` swaps the wrapper while an ``auto`` trial
    runs (a re-wrap with another cap and ``init_sync=False``: the replicas are equal at a step
    boundary; every other DDP option and the comm hook kept). Trial steps are ordinary training
    steps, their updates kept. Rank 0's timings decide and the choice is broadcast, so every rank
    wraps the same buckets. A checkpoint ends a trial (:meth:`settle`: the choice from what was
    measured so far), so the checkpoint holds the choice and a resume replays it. Epochs shorter
    than ``EPOCH_SHARE`` trials keep torch's default (a trial there would be most of the run).
    """

    def __init__(self, setting: str | float = AUTO, *, fractions: tuple[int, ...] = FRACTIONS,
                 rounds: int = ROUNDS, timed_steps: int = TIMED_STEPS,
                 threshold: float = THRESHOLD) -> None:
        self.setting = parse_bucket_mb(setting)
        self.fractions, self.rounds, self.timed_steps = fractions, rounds, timed_steps
        self.threshold = threshold
        self.cap: float | None = None  # the cap of the wrapper in use (None: torch's default)
        self.decisions: list[dict[str, Any]] = []  # one per model, for the report
        self._trial: dict[str, Any] | None = None

    # -- the model's phases ------------------------------------------------------------------
    def start(self, model: nn.Module, phase: str, steps_per_epoch: int,
              distributed: bool = True) -> float | None:
        """A new model to train (``phase`` names when): the cap to wrap it with now."""
        self._trial = None
        grads = gradient_mib(model)
        decision: dict[str, Any] = {"phase": phase, "gradient_mib": round(grads, 4)}
        if not distributed:
            self.cap, decision["rule"] = None, "no DDP wrapper (one process, or --sync diloco)"
        elif self.setting == TORCH:
            self.cap, decision["rule"] = None, "torch's default buckets (--bucket-mb torch)"
        elif self.setting != AUTO:
            self.cap, decision["rule"] = float(self.setting), "fixed by --bucket-mb"
        else:
            candidates = [None, *sorted({round(grads / f, 4) for f in self.fractions},
                                        reverse=True)]
            schedule = [c for r in range(self.rounds)
                        for c in (candidates if r % 2 == 0 else candidates[::-1])]
            needed = len(schedule) * (1 + self.timed_steps)
            self.cap = None
            if steps_per_epoch < EPOCH_SHARE * needed:
                decision["rule"] = (f"torch's default: an epoch of {steps_per_epoch} steps is "
                                    f"too short for a {needed}-step trial")
            else:
                self._trial = {"decision": decision, "schedule": schedule, "visit": 0,
                               "step": 0, "times": {_label(c): [] for c in candidates}}
                self._trial["rounds"] = [r for r in range(self.rounds) for _ in candidates]
                return None
        decision["cap_mib"] = self.cap
        self.decisions.append(decision)
        return self.cap

    @property
    def trying(self) -> bool:
        return self._trial is not None

    @contextlib.contextmanager
    def step(self, replica: Any) -> Iterator[None]:
        """Time the step in the ``with`` block; during a trial, re-wrap ``replica.wrapped`` first
        or after as the schedule says."""
        trial = self._trial
        if trial is None or not isinstance(replica.wrapped, DistributedDataParallel):
            yield
            return
        cap = trial["schedule"][trial["visit"]]
        if trial["step"] == 0 and cap != self.cap:
            self.rewrap(replica, cap)
        _synchronize()  # on a GPU the host's clock sees launches, not the step's work
        t0 = time.perf_counter()
        yield
        _synchronize()
        seconds = time.perf_counter() - t0
        if trial["step"] > 0:  # the first step after a wrap assigns the buckets
            trial["times"][_label(cap)].append((trial["rounds"][trial["visit"]], seconds))
        trial["step"] += 1
        if trial["step"] > self.timed_steps:
            trial["visit"], trial["step"] = trial["visit"] + 1, 0
            if trial["visit"] == len(trial["schedule"]):
                self.settle(replica)

    def settle(self, replica: Any) -> None:
        """End a running trial now: choose from what was measured (rank 0's), on every rank."""
        trial, self._trial = self._trial, None
        if trial is None:
            return
        decision = broadcast_object(self._decide(trial))
        self.decisions.append(decision)
        if decision["cap_mib"] != self.cap:
            self.rewrap(replica, decision["cap_mib"])

    def _decide(self, trial: dict[str, Any]) -> dict[str, Any]:
        times = {label: ts for label, ts in trial["times"].items() if ts}
        medians = {label: statistics.median(t for _, t in ts) for label, ts in times.items()}
        per_round = {label: {r: statistics.median(t for q, t in ts if q == r) for r, _ in ts}
                     for label, ts in times.items()}
        base = per_round.get(TORCH, {})

        def clearly_faster(label: str) -> bool:  # overall and in every round that timed both
            both = [r for r in per_round[label] if r in base]
            return bool(both) and all(
                per_round[label][r] <= (1 - self.threshold) * base[r] for r in both) and \
                medians[label] <= (1 - self.threshold) * medians[TORCH]

        winners = [label for label in medians if label != TORCH and clearly_faster(label)]
        chosen = min(winners, key=medians.__getitem__) if winners else TORCH
        return {**trial["decision"], "cap_mib": None if chosen == TORCH else float(chosen),
                "rule": f"the fastest median step among caps {100 * self.threshold:g}% faster "
                        "than torch's default overall and in every round, else torch's default",
                "median_ms": {k: round(1e3 * v, 2) for k, v in medians.items()},
                "round_ms": {k: [round(1e3 * v, 2) for v in rs.values()]
                             for k, rs in per_round.items()},
                "timed_steps": {k: len(v) for k, v in trial["times"].items()}}

    def rewrap(self, replica: Any, cap: float | None) -> None:
        """``replica.wrapped`` re-built with buckets of ``cap`` MiB, every other option and the
        comm hook kept (every rank, at a step boundary)."""
        replica.wrapped = rewrap_ddp(replica.wrapped, init_sync=False, **bucket_overrides(cap))
        self.cap = cap

    # -- report and checkpoint ---------------------------------------------------------------
    def describe(self) -> str:
        """One line per decision, for the run's output and the factorization report."""
        lines = []
        for d in self.decisions:
            cap = "torch's default" if d["cap_mib"] is None else f"{d['cap_mib']:.4g} MiB"
            line = f"gradient buckets ({d['phase']}, {d['gradient_mib']:.3g} MiB): {cap}; {d['rule']}"
            if d.get("median_ms"):
                line += "; median step " + ", ".join(
                    f"{k if k == TORCH else k + ' MiB'} {v:.1f} ms"
                    for k, v in d["median_ms"].items())
            lines.append(line)
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """The cap in use and the decisions; a trial is never saved (:meth:`settle` first)."""
        return {"cap_mib": self.cap, "decisions": list(self.decisions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap, self.decisions, self._trial = state["cap_mib"], list(state["decisions"]), None
        if self.setting not in (AUTO, TORCH):  # the user fixed the cap for this continuation
            self.cap = float(self.setting)
        elif self.setting == TORCH:
            self.cap = None


def _synchronize() -> None:
    """Wait for this process's queued GPU work (nothing on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
