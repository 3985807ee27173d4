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
    u, s, vh = _svd(weight.detach().to(torch.float64), rank)
    root = s.sqrt()
    left = u * root
    right = root[:, None] * vh
    return left.to(weight.dtype), right.to(weight.dtype)


def _svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``rank`` singular triplets of ``w`` (float64): ``u``, ``s``, ``vh``.

    A matrix at least twice as wide as tall (a conv's ``out x in·k·k``, e.g. VGG's 512 x 4608),
    or tall, goes through the eigenvectors ``U`` of the small Gram matrix ``w wᵀ`` and
    ``Vᵀ = Σ⁻¹ Uᵀ w``: LAPACK's SVD of VGG's widest layer took 4.2 s on one core, this 0.25 s.
    ``u Σ vh`` is then the projection ``U Uᵀ w``, exact whatever the spectrum; the squared
    spectrum costs precision only where a kept singular value is under 1e-4 of the largest, and
    those matrices take the SVD.
    """
    m, n = w.shape
    a = w if n >= m else w.T  # short side first: a is k x l, k <= l
    if a.shape[1] >= 2 * a.shape[0]:
        values, vectors = torch.linalg.eigh(a @ a.T)  # ascending
        s = values.flip(0)[:rank].clamp_min(0).sqrt()
        if s[0] > 0 and s[-1] > 1e-4 * s[0]:
            u = vectors.flip(1)[:, :rank]
            vh = (u.T @ a) / s[:, None]
            return (u, s, vh) if a is w else (vh.T, s, u.T)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return u[:, :rank], s[:rank], vh[:rank]


def rank_from_ratio(full_rank: int, ratio: float) -> int:
    """The rank kept for ``ratio`` of ``full_rank``: ``round(ratio * full_rank)``, at least 1."""
    if not (isinstance(ratio, int | float) and 0 < ratio <= 1) or isinstance(ratio, bool):
        raise ValueError(f"rank ratio {ratio!r} is out of range: allowed 0 < ratio <= 1")
    return max(1, min(full_rank, math.floor(ratio * full_rank + 0.5)))


def saves_parameters(m: int, n: int, rank: int) -> bool:
    """Whether ``r·(m+n) < m·n``: a rank-``r`` factorization of an ``m x n`` matrix is smaller."""
    return rank * (m + n) < m * n
