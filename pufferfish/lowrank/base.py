"""What every low-rank layer promises, and the registry that maps dense types to them.

A low-rank layer is a small wrapper around the factors of one dense module (the PEFT/LoRA shape):
``LowRankX.from_dense(dense, rank)`` builds it by truncated SVD and ``to_dense()`` merges it back.
``factorize`` never special-cases a layer type; it only asks the class registered for the dense
type these questions:

- ``unsupported_reason(dense)``: ``None``, or why this instance cannot be factorized
  (a grouped conv, a bidirectional LSTM, ...), shown in the report;
- ``full_rank(dense)``: the largest meaningful rank;
- ``params_at_rank(dense, rank)``: how many parameters the replacement would hold, so the
  report can say "no parameter saving" before building anything.

Third-party code adds a layer type with :func:`register_low_rank`.
"""

from __future__ import annotations

from typing import ClassVar, Self

import torch
from torch import nn

__all__ = ["LowRankModule", "low_rank_class_for", "register_low_rank"]

_REGISTRY: dict[type[nn.Module], type[LowRankModule]] = {}


class LowRankModule(nn.Module):
    """Base class of the pre-factorized replacements of dense layers."""

    dense_type: ClassVar[type[nn.Module]]
    rank: int

    @classmethod
    def unsupported_reason(cls, dense: nn.Module) -> str | None:
        return None

    @classmethod
    def full_rank(cls, dense: nn.Module) -> int:
        raise NotImplementedError

    @classmethod
    def params_at_rank(cls, dense: nn.Module, rank: int) -> int:
        raise NotImplementedError

    @classmethod
    def from_dense(cls, dense: nn.Module, rank: int, **options: object) -> Self:
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(left, right)`` 2-D factor pairs whose products are this layer's dense matrices.

        Used by Frobenius decay (penalize ``‖left @ right‖²``) and by spectral diagnostics.
        """
        raise NotImplementedError


def register_low_rank(dense_type: type[nn.Module], low_rank_type: type[LowRankModule]) -> None:
    """Make ``factorize`` replace modules of exactly ``dense_type`` by ``low_rank_type``."""
    _REGISTRY[dense_type] = low_rank_type


def low_rank_class_for(module: nn.Module) -> type[LowRankModule] | None:
    """The registered low-rank class for ``module``'s exact type (subclasses may change forward)."""
    return _REGISTRY.get(type(module))
