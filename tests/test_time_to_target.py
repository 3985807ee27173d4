"""The one time-to-target rule (pufferfish/bench/time_to_target.py) on curves with known answers."""

from __future__ import annotations

import math

from pufferfish.bench import time_to_target as ttt

LOSS = [(100, 5.0), (200, 4.0), (300, 3.0)]  # (step, validation loss): lower is better


def test_reach_takes_the_first_point_at_or_past_the_target() -> None:
    assert ttt.reach(LOSS, 4.0) == 200
    assert ttt.reach(LOSS, 3.5) == 300
    assert ttt.reach(LOSS, 6.0) == 100  # the first evaluation already there
    assert ttt.reach(LOSS, 2.0) is None
    accuracy = [(1, 0.80), (2, 0.90), (3, 0.85)]
    assert ttt.reach(accuracy, 0.86, higher_is_better=True) == 2
    assert ttt.reach(accuracy, 0.95, higher_is_better=True) is None


def test_interpolation_finds_the_crossing_between_two_evaluations() -> None:
    assert ttt.reach(LOSS, 3.5, interpolate=True) == 250.0
    assert ttt.reach(LOSS, 4.75, interpolate=True) == 125.0
    assert ttt.reach(LOSS, 6.0, interpolate=True) == 100  # nothing before the first point
    # a perplexity crossed log-linearly: interpolate its logarithm (the loss)
    ppl = [(s, math.exp(q)) for s, q in LOSS]
    at = ttt.reach([(s, math.log(p)) for s, p in ppl], math.log(math.exp(3.5)), interpolate=True)
    assert math.isclose(at, 250.0)


def test_cumulative_counts_each_phase_up_to_a_fractional_position() -> None:
    phases = [(10, 2.0), (math.inf, 0.5)]  # 10 steps of 2 s (before a switch), then 0.5 s each
    assert ttt.cumulative(4, phases) == 8.0  # still in the first phase
    assert ttt.cumulative(10, phases) == 20.0
    assert ttt.cumulative(12.5, phases) == 21.25
    assert ttt.cumulative(7, [(0, 9.0), (math.inf, 1.0)]) == 7.0  # no first phase: full rank
    assert ttt.phase_ends([(3, 1.0), (3, 2.0), (3, 1.0)]) == [3.0, 9.0, 12.0]


def test_time_range_is_the_best_and_worst_round() -> None:
    phases = [(10, ttt.StepTime(2.0, 1.5, 3.0)), (math.inf, ttt.StepTime(0.5, 0.4, 0.6))]
    t = ttt.time_range(12, phases)
    # median 10 x 2 + 2 x 0.5; best round 10 x 1.5 + 2 x 0.4; worst 10 x 3 + 2 x 0.6
    assert [round(x, 9) for x in (t.median, t.low, t.high)] == [21.0, 15.8, 31.2]
    assert ttt.time_range(3, [(math.inf, ttt.StepTime.exact(2.0))]) == ttt.StepTime.exact(6.0)
