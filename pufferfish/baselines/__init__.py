"""Baselines Pufferfish is compared with: the lottery ticket and structured channel pruning.

Importing this package registers the training modes ``lth``
(:class:`~pufferfish.baselines.lth.LotteryTicketMethod`) and ``prune``
(:class:`~pufferfish.baselines.slimming.SlimmingMethod`) with the loop;
:func:`~pufferfish.baselines.compare.compare` runs all of them side by side (``pufferfish compare``).
"""

from __future__ import annotations

from ..training.methods import register_method
from .lth import LotteryTicketMethod
from .slimming import SlimmingMethod

register_method("lth", LotteryTicketMethod)
register_method("prune", SlimmingMethod)

__all__ = ["LotteryTicketMethod", "SlimmingMethod"]
