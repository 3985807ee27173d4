"""Stable rank: how many singular values of a layer's matrices are comparable to the largest.

:class:`StableRankTracker` records it for every factorizable layer over training: the switch
detector watches it settle, and Cuttlefish's rank rule reads it (:mod:`.ranks`). Which matrices
a layer has is its low-rank class's answer (``dense_matrices``, :mod:`pufferfish.lowrank.base`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..lowrank.base import LowRankModule, low_rank_class_for
from ..lowrank.factorize import factorizable_modules

__all__ = ["StableRankTracker", "layer_matrix", "layer_stable_rank", "stable_rank"]


@torch.no_grad()
def stable_rank(weight: torch.Tensor) -> float:
    """``‖W‖²_F / ‖W‖²₂`` of a 2-D matrix: a smooth, scale-free lower bound of its rank.

    It lies in ``[1, rank(W)]``: ``n`` for an identity or orthogonal ``n x n`` matrix, 1 for a
    rank-one matrix, and it counts how many singular values are comparable to the largest one, so
    unlike the rank it is insensitive to tiny singular values. Computed from one ``svdvals`` in at
    least float32 (``Σσ² / σ₁²``). A zero matrix has stable rank 0 by convention.
    """
    if weight.dim() != 2:
        raise ValueError(f"stable_rank expects a 2-D matrix, got shape {tuple(weight.shape)}; "
                         "use layer_matrix(module) for a conv, LSTM or attention layer")
    w = weight.detach()
    if w.dtype not in (torch.float32, torch.float64):
        w = w.float()
    s = torch.linalg.svdvals(w)
    top = s[0] if s.numel() else s.new_zeros(())
    if top.item() == 0.0:
        return 0.0
    return ((s / top) ** 2).sum().item()


def layer_matrix(module: nn.Module) -> torch.Tensor | list[torch.Tensor]:
    """The 2-D matrix (or matrices) whose rank a layer's factorization truncates.

    - ``nn.Linear``: ``weight`` (``out x in``);
    - ``nn.Conv2d`` (or any module with a ≥2-D ``weight``): ``weight`` reshaped to
      ``(out, in·kh·kw)``, the matrix :class:`~pufferfish.lowrank.LowRankConv2d` splits;
    - ``nn.LSTM``: the list ``[W_ih_l0, W_hh_l0, W_ih_l1, ...]``;
    - ``nn.MultiheadAttention``: the list ``[W_q, W_k, W_v, W_out]``;
    - any other registered type: its class's ``dense_matrices`` (:mod:`pufferfish.lowrank.base`);
    - a :class:`~pufferfish.lowrank.LowRankModule`: the products ``left @ right`` of its factor
      pairs (one matrix when there is one pair), so a factorized model can be tracked too.

    The matrices share storage with the parameters where possible; callers only read them.
    """
    if isinstance(module, LowRankModule):
        matrices = [left @ right for left, right in module.factor_pairs()]
    else:
        matrices = (low_rank_class_for(module) or LowRankModule).dense_matrices(module)
    return matrices[0] if len(matrices) == 1 else matrices


def layer_stable_rank(module: nn.Module) -> float:
    """Stable rank of a layer: of its matrix, or the mean over its matrices (LSTM, attention)."""
    matrices = layer_matrix(module)
    if isinstance(matrices, torch.Tensor):
        return stable_rank(matrices)
    return sum(stable_rank(m) for m in matrices) / len(matrices)


class StableRankTracker:
    """Records the stable rank of every factorizable layer of ``model`` over training.

    At construction it records the factorizable modules (those ``factorize`` could replace, minus
    any matching a ``keep`` glob pattern) and their stable ranks at initialization in
    ``initial`` (name -> float): Cuttlefish's rank rule divides by it. Each :meth:`observe` call
    appends ``(t, value)`` to ``history[name]`` (the initial values are *not* in ``history``).

    Cost: one ``svdvals`` per matrix per call — milliseconds for a ResNet-18 on a GPU, a fraction of
    a second on a CPU — so a few times per epoch is free and once per step is not.

    Attributes:
        modules: name -> tracked module (the dense module, even after the model is factorized).
        full_ranks: name -> the layer class's ``full_rank``.
        initial: name -> stable rank at construction.
        history: name -> list of ``(t, stable rank)``, one per :meth:`observe` call.
    """

    def __init__(self, model: nn.Module, keep: Iterable[str] = ()) -> None:
        self.modules: dict[str, nn.Module] = factorizable_modules(model, keep)
        self.full_ranks: dict[str, int] = {}
        for name, module in self.modules.items():
            cls = low_rank_class_for(module)
            assert cls is not None
            self.full_ranks[name] = cls.full_rank(module)
        self.initial: dict[str, float] = self.current()
        self.history: dict[str, list[tuple[float, float]]] = {name: [] for name in self.modules}

    def current(self) -> dict[str, float]:
        """Every tracked layer's stable rank now, without recording it."""
        return {name: layer_stable_rank(m) for name, m in self.modules.items()}

    def observe(self, t: float) -> dict[str, float]:
        """Compute every tracked layer's stable rank, append it to ``history`` at time ``t``."""
        values = self.current()
        for name, value in values.items():
            self.history[name].append((t, value))
        return values
