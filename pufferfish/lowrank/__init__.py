"""Low-rank layers and whole-model factorization (knows nothing of training)."""

from .attention import LowRankMultiheadAttention
from .base import LowRankModule, low_rank_class_for, register_low_rank
from .counting import call_with_example, count_macs
from .factorize import factorize
from .layers import LowRankConv2d, LowRankLinear
from .lstm import LowRankLSTM
from .presets import presets_of, register_presets
from .report import FactorizationReport, LayerDecision
from .roundtrip import load_factorized, merge
from .svd import rank_from_ratio, saves_parameters, svd_split

__all__ = [
    "FactorizationReport",
    "LayerDecision",
    "LowRankConv2d",
    "LowRankLSTM",
    "LowRankLinear",
    "LowRankModule",
    "LowRankMultiheadAttention",
    "call_with_example",
    "count_macs",
    "factorize",
    "load_factorized",
    "low_rank_class_for",
    "merge",
    "presets_of",
    "rank_from_ratio",
    "register_low_rank",
    "register_presets",
    "saves_parameters",
    "svd_split",
]
