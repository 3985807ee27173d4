"""Baselines Pufferfish is compared with: the lottery ticket and structured channel pruning.

The training modes ``lth`` (:class:`~pufferfish.baselines.lth.LotteryTicketMethod`) and ``prune``
(:class:`~pufferfish.baselines.slimming.SlimmingMethod`) are in the loop's method registry
(:mod:`pufferfish.training.methods`), which imports them when first used;
:func:`~pufferfish.baselines.compare.compare` runs all of them side by side (``pufferfish compare``).
"""

from __future__ import annotations

from .lth import LotteryTicketMethod
from .slimming import SlimmingMethod

__all__ = ["LotteryTicketMethod", "SlimmingMethod"]
