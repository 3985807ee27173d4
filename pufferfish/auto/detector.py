"""When to end the full-rank warm-up: once every layer's stable rank has stopped moving."""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise

__all__ = ["SwitchDetector"]


class SwitchDetector:
    """Says when to end full-rank warm-up: when every layer's stable rank has stopped changing.

    Time ``t`` is measured in epochs and may be fractional: observe once per epoch, as Cuttlefish
    does, or every N steps (``t = epoch + step / steps_per_epoch``), which lets the test look at
    a full window within short runs. For each layer, from the values ``s_i`` observed at ``t_i``:

        D_t = Σ_{t_i > t − window} |s_i − s_{i−1}| / s_{i−1}  /  (t − t_j)

    where ``t_j`` is the last observation at or before ``t − window``: the relative change per
    epoch over (at least) the last ``window`` epochs, summed step by step so that a rank that rises
    and falls back is not mistaken for a flat one. With one observation per epoch this is the
    mean of the last ``window`` relative changes. ``0/0`` counts as no change.

    :meth:`update` returns ``True`` — on exactly one call, recorded in ``switched_at`` and
    ``reason`` (``"settled"`` or ``"cap"``) — when
    ``t ≥ min_epochs`` and ``D_t < threshold`` for EVERY layer (a layer needs observations
    reaching back ``window`` epochs before it can count as settled), or unconditionally when
    ``t ≥ max_epochs``. Afterwards it returns ``False``. A caller that may only switch at epoch
    boundaries (the training loop) switches at the first boundary at or after ``switched_at``.

    Tuning guide:

    - ``threshold`` (0.05): the largest relative change per epoch still called "flat". Stable
      ranks typically fall by 10-50% per epoch early on and then move by a few percent; lower it
      (0.01-0.02) to wait for a firmer plateau (safer ranks, longer full-rank phase), raise it
      (0.1) to switch early and save more compute.
    - ``window`` (1.0 epoch): how far back the change is averaged; longer resists noise (small
      batches, a high learning rate, a learning-rate warm-up) at the cost of switching at least
      ``window`` epochs into training. Observe a few times per window, so that noise averages out
      and a rise-and-fall inside the window is seen.
    - ``min_epochs`` (1): never switch before this; set it past a learning-rate warm-up, during
      which ranks can look flat before real training starts.
    - ``max_epochs`` (None): always switch here, a budget cap (Pufferfish's fixed warm-up length
      is the special case ``threshold=0``); the training CLI uses half the run.
    """

    def __init__(self, window: float = 1.0, threshold: float = 0.05, min_epochs: float = 1,
                 max_epochs: float | None = None) -> None:
        if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
            raise ValueError(f"window {window!r} is out of range: allowed a number of epochs > 0")
        if not threshold >= 0:
            raise ValueError(f"threshold {threshold!r} is out of range: allowed >= 0")
        if max_epochs is not None and max_epochs < min_epochs:
            raise ValueError(f"max_epochs {max_epochs} is below min_epochs {min_epochs}")
        self.window, self.threshold = float(window), threshold
        self.min_epochs, self.max_epochs = min_epochs, max_epochs
        self.times: list[float] = []
        self.values: dict[str, list[float]] = {}
        self.switched_at: float | None = None
        self.reason: str | None = None  # "settled" or "cap", once fired

    def smoothed_change(self, name: str) -> float:
        """``D_t`` of layer ``name`` at the last observation; ``inf`` until the window is full."""
        s = self.values.get(name, [])
        if len(s) < 2:
            return math.inf
        times = self.times[-len(s):]
        since = times[-1] - self.window
        j = max((i for i, t in enumerate(times) if t <= since + 1e-9), default=None)
        if j is None:  # (j < len(s) - 1 always: the window is > 0)
            return math.inf
        changes = [_relative_change(a, b) for a, b in pairwise(s[j:])]
        return sum(changes) / (times[-1] - times[j])

    def update(self, t: float, stable_ranks: Mapping[str, float]) -> bool:
        """Record the stable ranks observed at ``t``; ``True`` iff training should switch now."""
        if self.times and t <= self.times[-1]:
            raise ValueError(f"t must increase between updates: got {t} after {self.times[-1]}")
        self.times.append(float(t))
        for name, value in stable_ranks.items():
            self.values.setdefault(name, []).append(float(value))
        if self.switched_at is not None:
            return False
        settled = t >= self.min_epochs and all(
            self.smoothed_change(name) < self.threshold for name in stable_ranks)
        capped = self.max_epochs is not None and t >= self.max_epochs
        if settled or capped:
            self.switched_at, self.reason = t, "settled" if settled else "cap"
        return settled or capped


def _relative_change(before: float, after: float) -> float:
    if before == 0:
        return 0.0 if after == 0 else math.inf
    return abs(after - before) / abs(before)
