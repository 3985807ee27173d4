"""Baselines Pufferfish is compared with: the lottery ticket, structured channel pruning, GaLore.

The training modes ``lth`` (:class:`~pufferfish.baselines.lth.LotteryTicketMethod`), ``prune``
(:class:`~pufferfish.baselines.slimming.SlimmingMethod`) and ``galore``
(:class:`~pufferfish.baselines.galore.GaLoreMethod`, imported only then: its package is optional)
are in the loop's method registry
(:mod:`pufferfish.training.methods`), which imports them when first used;
:func:`~pufferfish.baselines.compare.compare` runs all of them side by side (``pufferfish compare``).
"""

from __future__ import annotations

from .lth import LotteryTicketMethod
from .slimming import SlimmingMethod

__all__ = ["LotteryTicketMethod", "SlimmingMethod"]
