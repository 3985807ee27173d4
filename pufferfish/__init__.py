"""pufferfish: communication-efficient distributed training with pre-factorized low-rank networks."""

from . import models
from .lowrank import (
    FactorizationReport,
    LowRankConv2d,
    LowRankLinear,
    LowRankLSTM,
    LowRankModule,
    LowRankMultiheadAttention,
    count_macs,
    factorize,
    merge,
    register_low_rank,
)
from .recipe import Recipe

__version__ = "0.1.0"
__all__ = [
    "FactorizationReport",
    "LowRankConv2d",
    "LowRankLSTM",
    "LowRankLinear",
    "LowRankModule",
    "LowRankMultiheadAttention",
    "Recipe",
    "count_macs",
    "factorize",
    "merge",
    "models",
    "register_low_rank",
]
