"""Baselines Pufferfish is compared with: the lottery ticket, structured channel pruning, GaLore.

The training modes ``lth`` (:class:`~pufferfish.baselines.lth.LotteryTicketMethod`), ``prune``
(:class:`~pufferfish.baselines.slimming.SlimmingMethod`) and ``galore``
(:class:`~pufferfish.baselines.galore.GaLoreMethod`, also the bench's ``galore``) are in the
loop's method registry (:mod:`pufferfish.training.methods`), which imports them when first used;
:func:`~pufferfish.baselines.compare.compare` runs the first two beside full rank and Pufferfish
(``pufferfish compare``).
"""

from __future__ import annotations

from .lth import LotteryTicketMethod
from .slimming import SlimmingMethod

__all__ = ["LotteryTicketMethod", "SlimmingMethod"]
