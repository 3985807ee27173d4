"""pufferfish: communication-efficient distributed training with pre-factorized low-rank networks."""

from .lowrank import LowRankConv2d, LowRankLinear, LowRankModule, register_low_rank

__version__ = "0.1.0"
__all__ = ["LowRankConv2d", "LowRankLinear", "LowRankModule", "register_low_rank"]
