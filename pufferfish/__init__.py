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
    load_factorized,
    merge,
    register_low_rank,
    svd_split,
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
    "load_factorized",
    "merge",
    "models",
    "register_low_rank",
    "svd_split",
    "swap_parameters",
]
