"""The one SVD split of Pufferfish.

Every low-rank layer is built from a dense weight ``W`` (``m x n``) by the same rule:
the truncated SVD ``W ≈ U_r Σ_r V_rᵀ`` whose singular values are shared evenly between the two
factors, ``left = U_r √Σ_r`` (``m x r``) and ``right = √Σ_r V_rᵀ`` (``r x n``).

Why the even √Σ split: both factors then have the same spectral norm, so the two layers that
replace one dense layer start with balanced weight scales and receive gradients of comparable size.
By Eckart–Young the error ``‖W - left @ right‖`` is the smallest any rank-``r`` matrix can reach:
its Frobenius norm is the root-sum-square of the dropped singular values.
"""

from __future__ import annotations

import math

import torch

__all__ = ["rank_from_ratio", "saves_parameters", "svd_split"]


@torch.no_grad()
def svd_split(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``weight`` (``m x n``) into ``left`` (``m x r``) and ``right`` (``r x n``).

    ``left @ right`` is the best rank-``rank`` approximation of ``weight``. The SVD is computed in
    float64 (cheap at layer sizes, and it keeps the full-rank round trip exact to fp32 precision);
    the factors come back in ``weight``'s dtype and device.
    """
    if weight.dim() != 2:
        raise ValueError(f"svd_split expects a 2-D weight, got shape {tuple(weight.shape)}")
    m, n = weight.shape
    if not 1 <= rank <= min(m, n):
        raise ValueError(f"rank {rank} is out of range: allowed 1..{min(m, n)} for a {m}x{n} weight")
    u, s, vh = torch.linalg.svd(weight.detach().to(torch.float64), full_matrices=False)
    root = s[:rank].sqrt()
    left = u[:, :rank] * root
    right = root[:, None] * vh[:rank]
    return left.to(weight.dtype), right.to(weight.dtype)


def rank_from_ratio(full_rank: int, ratio: float) -> int:
    """The rank kept for ``ratio`` of ``full_rank``: ``round(ratio * full_rank)``, at least 1."""
    if not (isinstance(ratio, int | float) and 0 < ratio <= 1) or isinstance(ratio, bool):
        raise ValueError(f"rank ratio {ratio!r} is out of range: allowed 0 < ratio <= 1")
    return max(1, min(full_rank, math.floor(ratio * full_rank + 0.5)))


def saves_parameters(m: int, n: int, rank: int) -> bool:
    """Whether ``r·(m+n) < m·n``: a rank-``r`` factorization of an ``m x n`` matrix is smaller."""
    return rank * (m + n) < m * n
