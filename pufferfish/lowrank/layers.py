"""Low-rank replacements of ``nn.Linear`` and ``nn.Conv2d``.

Both follow the paper: the dense weight ``W ≈ U√Σ · √ΣVᵀ`` becomes two layers applied in turn,
first ``v`` (weight ``√ΣVᵀ``: input -> rank) and then ``u`` (weight ``U√Σ``: rank -> output),
the bias staying with ``u`` so that the output is the dense layer's at full rank.

To code that reads them, both look like the dense layer: its attributes (``in_features``,
``kernel_size``, ``stride``, ...) and read-only ``weight``/``bias`` properties, the merged product
computed from the factors on each read (``bias`` with the extra BN folded in, as ``to_dense``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

import torch
from torch import nn

from .base import LowRankModule, register_low_rank
from .svd import svd_split

__all__ = ["LowRankConv2d", "LowRankLinear"]


class LowRankLinear(LowRankModule):
    """``nn.Linear(in, out)`` as ``Linear(in, r, bias=False)`` then ``Linear(r, out)``."""

    dense_type = nn.Linear

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.v = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.u = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))

    @property
    def weight(self) -> torch.Tensor:
        """The merged ``(out_features, in_features)`` weight ``u @ v`` (read-only, not a parameter)."""
        return self.u.weight @ self.v.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.u.bias

    @classmethod
    def full_rank(cls, dense: nn.Linear) -> int:
        return min(dense.in_features, dense.out_features)

    @classmethod
    def params_at_rank(cls, dense: nn.Linear, rank: int, **options: object) -> int:
        bias = dense.out_features if dense.bias is not None else 0
        return rank * (dense.in_features + dense.out_features) + bias

    @classmethod
    def from_dense(cls, dense: nn.Linear, rank: int, **options: object) -> Self:
        w = dense.weight
        layer = cls(dense.in_features, dense.out_features, rank, bias=dense.bias is not None,
                    device=w.device, dtype=w.dtype)
        left, right = svd_split(w, rank)
        with torch.no_grad():
            layer.u.weight.copy_(left)
            layer.v.weight.copy_(right)
            if dense.bias is not None:
                layer.u.bias.copy_(dense.bias)
        return layer

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        return state["v.weight"].shape[0], {}

    def to_dense(self) -> nn.Linear:
        w = self.u.weight
        dense = nn.Linear(self.in_features, self.out_features, bias=self.u.bias is not None,
                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            dense.weight.copy_(self.weight)
            if self.u.bias is not None:
                dense.bias.copy_(self.u.bias)
        return dense

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.u.weight, self.v.weight)]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.u.bias is not None}")


class LowRankConv2d(LowRankModule):
    """A k×k ``nn.Conv2d`` as a k×k conv to ``rank`` channels followed by a 1×1 conv.

    The k×k factor carries the original stride, padding, dilation and padding mode and no bias; the
    1×1 factor carries the bias. ``extra_bn=True`` puts a ``BatchNorm2d(rank)`` between the two
    (the paper's "extra BN" variant, which it found to help accuracy of low-rank ResNets); the BN
    starts as the identity map and is folded back into the factors by ``to_dense``.
    Grouped and depthwise convolutions are not factorized: their weight is already block-diagonal.
    """

    dense_type = nn.Conv2d

    def __init__(self, in_channels: int, out_channels: int, kernel_size: tuple[int, int], rank: int,
                 stride: tuple[int, int] = (1, 1), padding: tuple[int, int] | str = (0, 0),
                 dilation: tuple[int, int] = (1, 1), bias: bool = True, padding_mode: str = "zeros",
                 extra_bn: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.rank = in_channels, out_channels, rank
        self.v = nn.Conv2d(in_channels, rank, kernel_size, stride=stride, padding=padding,
                           dilation=dilation, bias=False, padding_mode=padding_mode,
                           device=device, dtype=dtype)
        self.bn = nn.BatchNorm2d(rank, device=device, dtype=dtype) if extra_bn else None
        self.u = nn.Conv2d(rank, out_channels, 1, bias=bias, device=device, dtype=dtype)
        # The dense conv's attributes, for code that reads them (torchvision, timm, HF).
        self.kernel_size = self.v.kernel_size
        self.stride, self.padding, self.dilation = self.v.stride, self.v.padding, self.v.dilation
        self.padding_mode, self.groups = padding_mode, 1
        self.transposed, self.output_padding = False, (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.v(x)
        if self.bn is not None:
            x = self.bn(x)
        return self.u(x)

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dense ``(weight, bias)``, the extra BN's inference-time affine map folded in."""
        left, right = self.u.weight.flatten(1), self.v.weight.flatten(1)
        bias = self.u.bias
        bn = self.bn
        if bn is not None:
            # z -> scale*z + shift between the factors: scale the right factor, shift the bias.
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            shift = bn.bias - bn.running_mean * scale
            right = right * scale[:, None]
            bias = left @ shift if bias is None else bias + left @ shift
        weight = (left @ right).reshape(self.out_channels, self.in_channels,
                                        self.kernel_size[0], self.kernel_size[1])
        return weight, bias

    @property
    def weight(self) -> torch.Tensor:
        """The merged ``(out, in, kh, kw)`` weight (read-only, not a parameter)."""
        return self._merged()[0]

    @property
    def bias(self) -> torch.Tensor | None:
        return self._merged()[1]

    @classmethod
    def unsupported_reason(cls, dense: nn.Conv2d) -> str | None:
        if dense.groups != 1:
            return f"grouped/depthwise conv (groups={dense.groups})"
        return None

    @classmethod
    def full_rank(cls, dense: nn.Conv2d) -> int:
        kh, kw = dense.kernel_size
        return min(dense.out_channels, dense.in_channels * kh * kw)

    @classmethod
    def params_at_rank(cls, dense: nn.Conv2d, rank: int, extra_bn: bool = False,
                       **options: object) -> int:
        kh, kw = dense.kernel_size
        bias = dense.out_channels if dense.bias is not None else 0
        bn = 2 * rank if extra_bn else 0
        return rank * (dense.in_channels * kh * kw + dense.out_channels) + bias + bn

    @classmethod
    def from_dense(cls, dense: nn.Conv2d, rank: int, extra_bn: bool = False,
                   **options: object) -> Self:
        w = dense.weight
        layer = cls(dense.in_channels, dense.out_channels, dense.kernel_size, rank,
                    stride=dense.stride, padding=dense.padding, dilation=dense.dilation,
                    bias=dense.bias is not None, padding_mode=dense.padding_mode,
                    extra_bn=extra_bn, device=w.device, dtype=w.dtype)
        left, right = svd_split(w.reshape(dense.out_channels, -1), rank)
        with torch.no_grad():
            layer.u.weight.copy_(left[:, :, None, None])
            layer.v.weight.copy_(right.reshape(rank, *w.shape[1:]))
            if dense.bias is not None:
                layer.u.bias.copy_(dense.bias)
        return layer

    @classmethod
    def rank_from_state_dict(cls, state: Mapping[str, torch.Tensor]
                             ) -> tuple[int, dict[str, object]]:
        return state["v.weight"].shape[0], {"extra_bn": "bn.weight" in state}

    def to_dense(self) -> nn.Conv2d:
        v, u = self.v, self.u
        with torch.no_grad():
            weight, bias = self._merged()
        dense = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, stride=v.stride,
                          padding=v.padding, dilation=v.dilation, bias=bias is not None,
                          padding_mode=v.padding_mode, device=u.weight.device, dtype=u.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(bias)
        return dense

    def factor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.u.weight.flatten(1), self.v.weight.flatten(1))]

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"rank={self.rank}, stride={self.v.stride}, padding={self.v.padding}, "
                f"extra_bn={self.bn is not None}")


register_low_rank(nn.Linear, LowRankLinear)
register_low_rank(nn.Conv2d, LowRankConv2d)
