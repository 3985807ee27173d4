"""Low-rank replacement of Hugging Face's ``Conv1D`` (GPT-2, GPT, DistilGPT-2, ...).

``Conv1D(nf, nx)`` is a linear layer with its weight stored transposed: ``weight`` is
``(nx, nf) = (in, out)`` and ``y = x @ weight + bias``. Its low-rank form is therefore
:class:`~pufferfish.lowrank.LowRankLinear`'s (``v``: in -> rank, ``u``: rank -> out, the SVD of
``weight.T``), so factor names, Frobenius decay and diagnostics are the same; only the dense view
(``weight`` of shape ``(nx, nf)``, ``nf``, ``nx``) and the merge back differ.

Imported by :func:`~pufferfish.lowrank.low_rank_class_for` the first time it meets a ``Conv1D``
(so ``transformers`` is already loaded): ``import pufferfish`` never imports ``transformers``.
"""

from __future__ import annotations

from typing import Self

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .base import register_low_rank
from .layers import LowRankLinear
from .svd import svd_split

__all__ = ["LowRankConv1D"]


class LowRankConv1D(LowRankLinear):
    """``transformers``' ``Conv1D(nf, nx)`` as ``Linear(nx, r, bias=False)`` then ``Linear(r, nf)``."""

    dense_type = Conv1D

    def __init__(self, nf: int, nx: int, rank: int, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(nx, nf, rank, bias=True, device=device, dtype=dtype)
        self.nf, self.nx = nf, nx

    @property
    def weight(self) -> torch.Tensor:
        """The merged ``(nx, nf)`` weight, stored as ``Conv1D`` stores it (read-only)."""
        return (self.u.weight @ self.v.weight).t()

    @classmethod
    def full_rank(cls, dense: nn.Module) -> int:
        return min(dense.nx, dense.nf)

    @classmethod
    def params_at_rank(cls, dense: nn.Module, rank: int, **options: object) -> int:
        return rank * (dense.nx + dense.nf) + dense.nf

    @classmethod
    def from_dense(cls, dense: nn.Module, rank: int, **options: object) -> Self:
        w = dense.weight
        layer = cls(dense.nf, dense.nx, rank, device=w.device, dtype=w.dtype)
        left, right = svd_split(w.t(), rank)
        with torch.no_grad():
            layer.u.weight.copy_(left)
            layer.v.weight.copy_(right)
            layer.u.bias.copy_(dense.bias)
        return layer

    def to_dense(self) -> Conv1D:
        w = self.u.weight
        dense = Conv1D(self.nf, self.nx).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            dense.weight.copy_(self.weight)
            dense.bias.copy_(self.u.bias)
        return dense

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, rank={self.rank}"


register_low_rank(Conv1D, LowRankConv1D)
