"""Time to a target: where a quality curve first reaches it, and the seconds of the steps before.

The one rule behind every time-to-target figure: the bench's time to accuracy
(:mod:`pufferfish.bench.accuracy`), ``benchmarks/diloco_tta.py`` (modelled links),
``benchmarks/lm_links.py`` (the budget study over measured links) and the claims built on them.
The quality a run reaches at a step does not depend on the link it trained over; the time does.
So a time to a target is two questions answered apart:

* :func:`reach`: the step (or epoch) at which the curve, a list of ``(position, quality)``
  points in order, first reaches the target: the first point at or past it, or, interpolating,
  where the line from the point before crosses it (lower is better for a loss or perplexity,
  higher for an accuracy; interpolate a perplexity in its logarithm, the loss);
* :func:`cumulative`: the seconds of the steps up to that position, when the steps run in
  phases of a step time each (a Pufferfish run steps at its full-rank counterpart's time before
  its switch and at its own after; a run's epochs at their measured times), or the bytes they
  send, with bytes per step in place of seconds.

:class:`StepTime` carries a step time with its spread over the bench's rounds, and
:func:`time_range` the seconds with every step time at its median, its low end and its high end:
the README's rule judges times in the bench's worst round (the high end).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StepTime", "cumulative", "phase_ends", "reach", "time_range"]


def reach(points: Sequence[tuple[float, float]], target: float, *,
          higher_is_better: bool = False, interpolate: bool = False) -> float | None:
    """The position of ``points`` (``(position, quality)`` in order) where the quality first
    reaches ``target`` (``None``: never): the first point at or past it, or, with
    ``interpolate``, the position where the line between it and the point before crosses it (an
    evaluation every 100 steps makes the first rule a step function of the target)."""
    before = None
    for position, quality in points:
        if (quality >= target) if higher_is_better else (quality <= target):
            if not interpolate or before is None:
                return position
            p0, q0 = before
            return p0 + (position - p0) * (q0 - target) / (q0 - quality)
        before = (position, quality)
    return None


def cumulative(position: float, phases: Sequence[tuple[float, float]]) -> float:
    """The sum over ``phases`` (``(steps, per step)`` in order; the last may run for
    ``math.inf`` steps) of the per-step figure times the steps of the phase among the first
    ``position`` (fractional where ``position`` is): seconds for step times, bytes for bytes."""
    total, start = 0.0, 0
    for steps, per_step in phases:
        total += per_step * max(0, min(position, start + steps) - start)
        start += steps
    return total


def phase_ends(phases: Sequence[tuple[float, float]]) -> list[float]:
    """The cumulative figure at the end of each phase (seconds at each epoch's end)."""
    return list(itertools.accumulate((steps * per_step for steps, per_step in phases),
                                     initial=0.0))[1:]


@dataclass(frozen=True)
class StepTime:
    """A step time in seconds with its spread (``low``/``high``; equal when modelled)."""

    median: float
    low: float
    high: float

    @classmethod
    def exact(cls, seconds: float) -> StepTime:
        return cls(seconds, seconds, seconds)


def time_range(position: float, phases: Sequence[tuple[float, StepTime]]) -> StepTime:
    """:func:`cumulative` of ``position`` steps with every step time at its median, its low end
    (the bench's best round) and its high end (its worst round)."""
    return StepTime(*(cumulative(position, [(n, getattr(t, end)) for n, t in phases])
                      for end in ("median", "low", "high")))
