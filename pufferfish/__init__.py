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
from .recipe import ParameterSwap, Recipe, swap_parameters

__version__ = "0.1.0"
__all__ = [
    "FactorizationReport",
    "LowRankConv2d",
    "LowRankLSTM",
    "LowRankLinear",
    "LowRankModule",
    "LowRankMultiheadAttention",
    "ParameterSwap",
    "Recipe",
    "count_macs",
    "factorize",
    "merge",
    "models",
    "register_low_rank",
    "swap_parameters",
]
