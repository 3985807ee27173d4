"""Which rank each layer gets: Cuttlefish's scaled stable rank (or an energy threshold), capped.

The rule reads each layer's spectrum (:mod:`.stable_rank`) and never returns a rank above the
largest that still saves parameters (:func:`saving_cap`), nor above a size budget
(``max_ratio``). The result is ``factorize(model, overrides=ranks)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import nn

from ..lowrank.base import low_rank_class_for
from ..lowrank.counting import count_params
from ..lowrank.factorize import factorizable_modules
from ..lowrank.selection import as_patterns, first_match
from ..lowrank.svd import rank_from_ratio
from .stable_rank import StableRankTracker, layer_matrix, layer_stable_rank

__all__ = ["budget_params", "choose_ranks", "saving_cap"]


def budget_params(model: nn.Module, max_ratio: float, keep: Iterable[str] = ()) -> int:
    """Parameter count of ``model`` with every factorizable layer (minus ``keep``) at ``max_ratio``.

    The size the automatic recipe must not exceed (``max_ratio=0.25`` with the model's preset in
    ``keep``: the paper's 1/4 preset). Layers whose rank at ``max_ratio`` saves nothing count dense.
    """
    total = count_params(model)
    for module in factorizable_modules(model, keep).values():
        cls = low_rank_class_for(module)
        assert cls is not None
        r = min(rank_from_ratio(cls.full_rank(module), max_ratio), saving_cap(module))
        if r >= 1:
            total -= count_params(module) - cls.params_at_rank(module, r)
    return total


def saving_cap(module: nn.Module) -> int:
    """Largest rank whose replacement holds fewer parameters than ``module`` (0 if none does)."""
    cls = low_rank_class_for(module)
    if cls is None:
        raise TypeError(f"{type(module).__name__} has no registered low-rank class")
    dense = count_params(module)
    lo, hi = 0, cls.full_rank(module)  # params_at_rank grows with the rank: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cls.params_at_rank(module, mid) < dense:
            lo = mid
        else:
            hi = mid - 1
    return lo


def choose_ranks(
    model_or_tracker: nn.Module | StableRankTracker,
    rule: Literal["cuttlefish", "energy"] = "cuttlefish",
    energy: float = 0.9,
    initial: Mapping[str, float] | None = None,
    keep: Iterable[str] = (),
    max_ratio: float | None = None,
    unsettled: Iterable[str] = (),
) -> dict[str, int]:
    """Qualified name -> rank for every factorizable layer; pass it as ``factorize(overrides=)``.

    Rules (``s`` a layer's stable rank, the mean over its matrices for LSTM/attention; ``R`` its
    class's ``full_rank``):

    - ``"cuttlefish"``: ``r = round(s_now · R / s_init)``. A randomly initialized layer is
      full-rank but its stable rank ``s_init`` is well below ``R`` (about ``R/4`` for a square
      Gaussian matrix), so the stable rank is rescaled by ``R / s_init`` to be read on the
      rank scale: a layer whose stable rank did not move keeps full rank, one whose stable rank
      halved gets half its rank. Needs ``s_init``: from a :class:`StableRankTracker` built before
      training, or ``initial`` (name -> stable rank at init). A layer whose ``s_init`` is 0 gets
      ``R``.
    - ``"energy"``: the smallest ``r`` with ``Σ_{i≤r} σ_i² ≥ energy · Σ σ_i²`` (the rank-``r``
      truncation keeps ``energy`` of the squared Frobenius norm); the max over an LSTM's or
      attention layer's matrices. Raise ``energy`` (0.95-0.99) for accuracy, lower it for size.

    Then, for both rules, ``r`` is clipped to ``[1, R]``, to ``rank_from_ratio(R, max_ratio)``
    when ``max_ratio`` is given (a size budget: ``0.25`` never makes a layer larger than the
    paper's ¼ preset would), and to :func:`saving_cap`, the largest rank whose replacement holds
    fewer parameters than the dense layer (``params_at_rank`` of the layer class vs the dense
    count). A layer that saves parameters at no rank gets ``R``, which ``factorize`` reports as
    "kept: no parameter saving".

    ``unsettled``: layers whose stable rank was still moving when the switch came (the detector
    reached its cap). A falling stable rank is not yet evidence of a low rank, so with
    ``max_ratio`` such a layer gets the budget's rank ``rank_from_ratio(R, max_ratio)`` instead of
    the rule's. Measured (docs/benchmarks.md, ResNet-18 at the paper's width, 20 epochs): ranks read
    from unsettled stable ranks at epoch 2 (down to 6 of 256) cost 0.16 and 0.26 points against the
    ¼ preset on two seeds, and the stable ranks behind them differed tenfold between the seeds.

    Why a budget: in short runs stable ranks barely fall from their initial values, so the
    Cuttlefish rule alone returns ranks near ``R`` (little saving, little speed-up). With
    ``max_ratio`` the automatic rule can only shrink a layer below the budget, where its spectrum
    says it can afford it.

    Layers: a tracker's (``keep`` is applied on top of the tracker's own), or
    ``factorizable_modules(model)`` minus those matching a ``keep`` glob pattern.
    """
    _check_rule(rule, energy, max_ratio)
    modules, init = _layers_and_initial(model_or_tracker, as_patterns(keep), initial)
    if rule == "cuttlefish":
        _check_initial(modules, init)
    ranks: dict[str, int] = {}
    fallback = set(unsettled) if max_ratio is not None else set()
    for name, module in modules.items():
        cls = low_rank_class_for(module)
        assert cls is not None
        full = cls.full_rank(module)
        if name in fallback:
            r = full  # capped to the budget's rank below
        elif rule == "cuttlefish":
            r = _cuttlefish_rank(module, full, float(init[name]))
        else:
            r = _energy_rank(module, energy)
        ranks[name] = _capped(module, r, full, max_ratio)
    return ranks


def _check_rule(rule: str, energy: float, max_ratio: float | None) -> None:
    if rule not in ("cuttlefish", "energy"):
        raise ValueError(f"rule {rule!r} is unknown: allowed 'cuttlefish', 'energy'")
    if rule == "energy" and not (isinstance(energy, int | float) and 0 < energy <= 1):
        raise ValueError(f"energy {energy!r} is out of range: allowed 0 < energy <= 1")
    if max_ratio is not None and not (isinstance(max_ratio, int | float) and 0 < max_ratio <= 1):
        raise ValueError(f"max_ratio {max_ratio!r} is out of range: allowed 0 < max_ratio <= 1")


def _layers_and_initial(model_or_tracker: nn.Module | StableRankTracker, keep: list[str],
                        initial: Mapping[str, float] | None
                        ) -> tuple[dict[str, nn.Module], Mapping[str, float]]:
    """The layers to rank (minus ``keep``) and their stable ranks at init (``{}``: unknown)."""
    if isinstance(model_or_tracker, StableRankTracker):
        tracker = model_or_tracker
        modules = {n: m for n, m in tracker.modules.items() if first_match([n], keep) is None}
        return modules, (tracker.initial if initial is None else initial) or {}
    return factorizable_modules(model_or_tracker, keep), initial or {}


def _check_initial(modules: Mapping[str, nn.Module], init: Mapping[str, float]) -> None:
    if not init and modules:
        raise ValueError("the cuttlefish rule needs the stable ranks at initialization: pass "
                         "a StableRankTracker built before training, or initial=")
    missing = [n for n in modules if n not in init]
    if missing:
        raise ValueError(f"initial has no stable rank for {', '.join(missing)}")


def _cuttlefish_rank(module: nn.Module, full: int, s_init: float) -> int:
    """``round(s_now · R / s_init)``: the stable rank read on the rank scale (``R`` if s_init=0)."""
    if not s_init > 0:
        return full
    return math.floor(layer_stable_rank(module) * full / s_init + 0.5)


def _energy_rank(module: nn.Module, energy: float) -> int:
    """The smallest rank keeping ``energy`` of every matrix's squared Frobenius norm."""
    matrices = layer_matrix(module)
    matrices = [matrices] if isinstance(matrices, torch.Tensor) else matrices
    return max(_matrix_energy_rank(m, energy) for m in matrices)


@torch.no_grad()
def _matrix_energy_rank(matrix: torch.Tensor, energy: float) -> int:
    s2 = torch.linalg.svdvals(matrix.detach().to(torch.float64)) ** 2
    total = s2.sum().item()
    if total == 0.0:
        return 1
    below = (torch.cumsum(s2, 0) < energy * total * (1 - 1e-12)).sum().item()
    return int(below) + 1


def _capped(module: nn.Module, rank: int, full: int, max_ratio: float | None) -> int:
    """``rank`` clipped to ``[1, R]``, the budget and :func:`saving_cap` (``R`` if nothing saves)."""
    rank = max(1, min(full, rank))
    if max_ratio is not None:
        rank = min(rank, rank_from_ratio(full, max_ratio))
    cap = saving_cap(module)
    return min(rank, cap) if cap >= 1 else full
