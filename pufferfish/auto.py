"""Automatic choices for Pufferfish: when to switch, which ranks, which layers stay full-rank.

Pufferfish trains a full-rank model for a hand-picked number of warm-up epochs, then factorizes
every layer at one hand-picked rank ratio (1/4) except a hand-picked set of layers. Cuttlefish
(Wang et al., MLSys 2023) removes all three choices, and Khodak et al. (ICLR 2021) replace weight
decay on the factors by Frobenius decay. This module holds the pure pieces; the training loop
wires them together:

1. **When to switch** — :class:`StableRankTracker` measures every factorizable layer's stable
   rank ``‖W‖²_F / ‖W‖²₂`` a few times per epoch; :class:`SwitchDetector` says "switch now" once all of
   them have stopped moving. Stable ranks drop fast early in training and then plateau; once they
   plateau the layer's "effective rank" is known, and more full-rank epochs only cost time.
2. **Which rank** — :func:`choose_ranks`: Cuttlefish's scaled stable rank (or an energy
   threshold on the spectrum), per layer, never above the largest rank that still saves
   parameters. The result is ``factorize(model, overrides=ranks)``.
3. **Which layers stay full-rank** — :func:`profile_keep`: time each layer dense and low-rank on
   the shapes it really sees; keep the ones where factorizing saves neither time nor parameters
   (small early convs, tiny heads). The result is ``factorize(model, keep=names)``.
4. **Regularization** — :func:`frobenius_decay` adds ``coeff/2 · Σ‖U V‖²_F`` over the factor
   pairs; exclude :func:`frobenius_decay_params` from the optimizer's plain weight decay.

Typical use::

    tracker, detector = StableRankTracker(model), SwitchDetector(max_epochs=epochs // 2)
    switched = False
    for epoch in range(epochs):
        train_one_epoch(model)
        if not switched and detector.update(epoch, tracker.observe(epoch)):
            ranks = choose_ranks(tracker)
            keep, timings = profile_keep(model, batch, ranks)
            report = factorize(model, overrides=ranks, keep=keep)
            switched = True
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import nn

from .lowrank.base import LowRankModule, low_rank_class_for
from .lowrank.factorize import call_with_example, factorizable_modules
from .lowrank.selection import ModuleIndex, as_patterns, first_match, resolve_rank
from .lowrank.svd import rank_from_ratio

__all__ = [
    "StableRankTracker",
    "SwitchDetector",
    "budget_params",
    "choose_ranks",
    "frobenius_decay",
    "frobenius_decay_params",
    "layer_matrix",
    "layer_stable_rank",
    "profile_keep",
    "saving_cap",
    "stable_rank",
    "time_kernels",
    "time_lstm_kernels",
]


# --------------------------------------------------------------------------------------------
# Stable rank
# --------------------------------------------------------------------------------------------

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


def _without_kept(model: nn.Module, keep: Iterable[str]) -> dict[str, nn.Module]:
    """``factorizable_modules`` minus those any of whose names matches a ``keep`` pattern."""
    keep = as_patterns(keep)
    index = ModuleIndex(model)
    index.check(keep)
    return {name: m for name, m in factorizable_modules(model).items()
            if index.first_match(m, keep) is None}


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
        self.modules: dict[str, nn.Module] = _without_kept(model, keep)
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


# --------------------------------------------------------------------------------------------
# When to switch
# --------------------------------------------------------------------------------------------

class SwitchDetector:
    """Says when to end full-rank warm-up: when every layer's stable rank has stopped changing.

    Time ``t`` is measured in epochs and may be fractional: observe once per epoch, as Cuttlefish
    does, or every N steps (``t = epoch + step / steps_per_epoch``), which lets the test look at
    a full window within short runs. For each layer, from the values ``s_i`` observed at ``t_i``:

        D_t = Σ_{t_i > t − window} |s_i − s_{i−1}| / s_{i−1}  /  (t − t_j)

    where ``t_j`` is the last observation at or before ``t − window``: the relative change per
    epoch over (at least) the last ``window`` epochs, summed step by step so that a rank that rises
    and falls back is not mistaken for a flat one. With one observation per epoch this is the
    mean of the last ``window`` relative changes. ``0/0`` counts as no change.

    :meth:`update` returns ``True`` — on exactly one call, recorded in ``switched_at`` and
    ``reason`` (``"settled"`` or ``"cap"``) — when
    ``t ≥ min_epochs`` and ``D_t < threshold`` for EVERY layer (a layer needs observations
    reaching back ``window`` epochs before it can count as settled), or unconditionally when
    ``t ≥ max_epochs``. Afterwards it returns ``False``. A caller that may only switch at epoch
    boundaries (the training loop) switches at the first boundary at or after ``switched_at``.

    Tuning guide:

    - ``threshold`` (0.05): the largest relative change per epoch still called "flat". Stable
      ranks typically fall by 10-50% per epoch early on and then move by a few percent; lower it
      (0.01-0.02) to wait for a firmer plateau (safer ranks, longer full-rank phase), raise it
      (0.1) to switch early and save more compute.
    - ``window`` (1.0 epoch): how far back the change is averaged; longer resists noise (small
      batches, a high learning rate, a learning-rate warm-up) at the cost of switching at least
      ``window`` epochs into training. Observe a few times per window, so that noise averages out
      and a rise-and-fall inside the window is seen.
    - ``min_epochs`` (1): never switch before this; set it past a learning-rate warm-up, during
      which ranks can look flat before real training starts.
    - ``max_epochs`` (None): always switch here, a budget cap (Pufferfish's fixed warm-up length
      is the special case ``threshold=0``); the training CLI uses half the run.
    """

    def __init__(self, window: float = 1.0, threshold: float = 0.05, min_epochs: float = 1,
                 max_epochs: float | None = None) -> None:
        if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
            raise ValueError(f"window {window!r} is out of range: allowed a number of epochs > 0")
        if not threshold >= 0:
            raise ValueError(f"threshold {threshold!r} is out of range: allowed >= 0")
        if max_epochs is not None and max_epochs < min_epochs:
            raise ValueError(f"max_epochs {max_epochs} is below min_epochs {min_epochs}")
        self.window, self.threshold = float(window), threshold
        self.min_epochs, self.max_epochs = min_epochs, max_epochs
        self.times: list[float] = []
        self.values: dict[str, list[float]] = {}
        self.switched_at: float | None = None
        self.reason: str | None = None  # "settled" or "cap", once fired

    def smoothed_change(self, name: str) -> float:
        """``D_t`` of layer ``name`` at the last observation; ``inf`` until the window is full."""
        s = self.values.get(name, [])
        if len(s) < 2:
            return math.inf
        times = self.times[-len(s):]
        since = times[-1] - self.window
        j = max((i for i, t in enumerate(times) if t <= since + 1e-9), default=None)
        if j is None:  # (j < len(s) - 1 always: the window is > 0)
            return math.inf
        changes = [_relative_change(a, b) for a, b in pairwise(s[j:])]
        return sum(changes) / (times[-1] - times[j])

    def update(self, t: float, stable_ranks: Mapping[str, float]) -> bool:
        """Record the stable ranks observed at ``t``; ``True`` iff training should switch now."""
        if self.times and t <= self.times[-1]:
            raise ValueError(f"t must increase between updates: got {t} after {self.times[-1]}")
        self.times.append(float(t))
        for name, value in stable_ranks.items():
            self.values.setdefault(name, []).append(float(value))
        if self.switched_at is not None:
            return False
        settled = t >= self.min_epochs and all(
            self.smoothed_change(name) < self.threshold for name in stable_ranks)
        capped = self.max_epochs is not None and t >= self.max_epochs
        if settled or capped:
            self.switched_at, self.reason = t, "settled" if settled else "cap"
        return settled or capped


def _relative_change(before: float, after: float) -> float:
    if before == 0:
        return 0.0 if after == 0 else math.inf
    return abs(after - before) / abs(before)


# --------------------------------------------------------------------------------------------
# Which rank
# --------------------------------------------------------------------------------------------

def budget_params(model: nn.Module, max_ratio: float, keep: Iterable[str] = ()) -> int:
    """Parameter count of ``model`` with every factorizable layer (minus ``keep``) at ``max_ratio``.

    The size the automatic recipe must not exceed (``max_ratio=0.25`` with the model's preset in
    ``keep``: the paper's 1/4 preset). Layers whose rank at ``max_ratio`` saves nothing count dense.
    """
    total = sum(p.numel() for p in model.parameters())
    for module in _without_kept(model, keep).values():
        cls = low_rank_class_for(module)
        assert cls is not None
        r = min(rank_from_ratio(cls.full_rank(module), max_ratio), saving_cap(module))
        if r >= 1:
            total -= sum(p.numel() for p in module.parameters()) - cls.params_at_rank(module, r)
    return total


def saving_cap(module: nn.Module) -> int:
    """Largest rank whose replacement holds fewer parameters than ``module`` (0 if none does)."""
    cls = low_rank_class_for(module)
    if cls is None:
        raise TypeError(f"{type(module).__name__} has no registered low-rank class")
    dense = sum(p.numel() for p in module.parameters())
    lo, hi = 0, cls.full_rank(module)  # params_at_rank grows with the rank: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cls.params_at_rank(module, mid) < dense:
            lo = mid
        else:
            hi = mid - 1
    return lo


@torch.no_grad()
def _energy_rank(matrix: torch.Tensor, energy: float) -> int:
    s2 = torch.linalg.svdvals(matrix.detach().to(torch.float64)) ** 2
    total = s2.sum().item()
    if total == 0.0:
        return 1
    below = (torch.cumsum(s2, 0) < energy * total * (1 - 1e-12)).sum().item()
    return int(below) + 1


def choose_ranks(
    model_or_tracker: nn.Module | StableRankTracker,
    rule: Literal["cuttlefish", "energy"] = "cuttlefish",
    energy: float = 0.9,
    initial: Mapping[str, float] | None = None,
    keep: Iterable[str] = (),
    max_ratio: float | None = None,
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

    Why a budget: in short runs stable ranks barely fall from their initial values, so the
    Cuttlefish rule alone returns ranks near ``R`` (little saving, little speed-up). With
    ``max_ratio`` the automatic rule can only shrink a layer below the budget, where its spectrum
    says it can afford it.

    Layers: a tracker's (``keep`` is applied on top of the tracker's own), or
    ``factorizable_modules(model)`` minus those matching a ``keep`` glob pattern.
    """
    if rule not in ("cuttlefish", "energy"):
        raise ValueError(f"rule {rule!r} is unknown: allowed 'cuttlefish', 'energy'")
    if rule == "energy" and not (isinstance(energy, int | float) and 0 < energy <= 1):
        raise ValueError(f"energy {energy!r} is out of range: allowed 0 < energy <= 1")
    if max_ratio is not None and not (isinstance(max_ratio, int | float) and 0 < max_ratio <= 1):
        raise ValueError(f"max_ratio {max_ratio!r} is out of range: allowed 0 < max_ratio <= 1")
    keep = as_patterns(keep)
    if isinstance(model_or_tracker, StableRankTracker):
        tracker = model_or_tracker
        modules = {n: m for n, m in tracker.modules.items() if first_match([n], keep) is None}
        init = tracker.initial if initial is None else initial
    else:
        modules = _without_kept(model_or_tracker, keep)
        init = initial
    init = init or {}
    if rule == "cuttlefish":
        if not init and modules:
            raise ValueError("the cuttlefish rule needs the stable ranks at initialization: pass "
                             "a StableRankTracker built before training, or initial=")
        missing = [n for n in modules if n not in init]
        if missing:
            raise ValueError(f"initial has no stable rank for {', '.join(missing)}")

    ranks: dict[str, int] = {}
    for name, module in modules.items():
        cls = low_rank_class_for(module)
        assert cls is not None
        full = cls.full_rank(module)
        if rule == "cuttlefish":
            s_init = float(init[name])
            if s_init > 0:
                r = math.floor(layer_stable_rank(module) * full / s_init + 0.5)
            else:
                r = full
        else:
            matrices = layer_matrix(module)
            matrices = [matrices] if isinstance(matrices, torch.Tensor) else matrices
            r = max(_energy_rank(m, energy) for m in matrices)
        r = max(1, min(full, r))
        if max_ratio is not None:
            r = min(r, rank_from_ratio(full, max_ratio))
        cap = saving_cap(module)
        ranks[name] = min(r, cap) if cap >= 1 else full
    return ranks


# --------------------------------------------------------------------------------------------
# Which layers stay full-rank
# --------------------------------------------------------------------------------------------

_MIN_REPEAT_S = 1e-3  # each timed repeat runs enough steps to last at least this long


def profile_keep(
    model: nn.Module,
    example_input: Any,
    ranks: Mapping[str, int | float],
    min_speedup: float = 1.0,
    min_param_share: float = 0.01,
    repeats: int = 5,
    warmup: int = 2,
    extra_bn: bool = False,
    max_params: int | None = None,
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Time each layer dense vs low-rank on its real input; list those not worth factorizing.

    Why: a rank that saves FLOPs does not always save time. Two small matmuls launch twice the
    kernels, and a 3x3 conv with few channels on a large feature map is memory-bound, so the
    first layers of a CNN or a tiny head can get *slower* when factorized while saving almost no
    parameters. Measuring replaces Pufferfish's hand-picked list of full-rank layers.

    How: one forward pass of ``example_input`` (eval mode, so BatchNorm statistics are untouched;
    training flags are restored) captures the positional and keyword inputs of every candidate
    layer through forward pre-hooks. Then, for each factorizable layer that a key of ``ranks``
    matches (exact name or glob, first match wins; an ``int`` is a rank, a ``float`` a ratio of
    the full rank, as in ``factorize(overrides=)``), a copy of the dense layer and its
    ``from_dense`` replacement at that rank are each timed for forward + backward (in train mode,
    gradients w.r.t. the parameters and w.r.t. the inputs that needed them in the model) on that
    input: ``warmup`` untimed steps, then the median of ``repeats`` timed repeats, the two
    variants interleaved so that drift on a shared machine hits both. The model is not modified.

    Decision: keep a layer full-rank iff BOTH

    - ``speedup = dense_ms / lowrank_ms < min_speedup`` (default 1.0: factorizing does not make
      it faster; raise to 1.1-1.2 to demand a clear win on noisy hardware), and
    - ``param_saving_share = (dense params − low-rank params) / model params < min_param_share``
      (default 0.01: it saves under 1% of the model; parameters are what Pufferfish's
      gradient communication sends, so a large saving is worth some compute).

    Budget: with ``max_params`` (e.g. the size of the model at the paper's 1/4 preset), layers
    kept for speed are factorized after all, the least slowed-down first, until the factorized
    model (``model`` params minus the savings of the layers factorized) fits; a layer kept only
    because it was slower then costs parameters that lower-than-budget ranks elsewhere freed.

    A layer with several kernels (``kernel_options()``: a :class:`~pufferfish.lowrank.LowRankLSTM`)
    is timed with each (``kernel_ms``) and judged by the fastest, which the recipe will run
    (:func:`time_kernels`).

    A layer whose rank saves no parameters is kept without timing; one that ``example_input``
    never calls is decided on parameters alone. Layers no key of ``ranks`` matches are not
    measured and not listed.

    Returns:
        ``(keep_names, measurements)``: the names to pass as ``factorize(keep=)``, and name ->
        ``{"rank", "full_rank", "input_shape", "dense_ms", "lowrank_ms", "speedup",
        "params_dense", "params_lowrank", "param_saving_share", "decision", "reason"}`` with
        ``decision`` ``"keep"`` or ``"factorize"`` and times in milliseconds per step (``None``
        when not timed).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats {repeats!r} is out of range: allowed an integer >= 1")
    modules = factorizable_modules(model)
    index = ModuleIndex(model)
    index.check(ranks)
    chosen: dict[str, tuple[nn.Module, int | float]] = {}
    for name, module in modules.items():
        hit = index.first_match(module, ranks)
        if hit is not None:
            chosen[name] = (module, ranks[hit])

    inputs = _capture_inputs(model, example_input, [m for m, _ in chosen.values()])
    total = sum(p.numel() for p in model.parameters())
    keep_names: list[str] = []
    measurements: dict[str, dict[str, Any]] = {}
    for name, (module, value) in chosen.items():
        cls = low_rank_class_for(module)
        assert cls is not None
        full = cls.full_rank(module)
        r = resolve_rank(value, full)
        before = sum(p.numel() for p in module.parameters())
        after = cls.params_at_rank(module, r, extra_bn=extra_bn)
        share = (before - after) / max(1, total)
        captured = inputs.get(id(module))
        m: dict[str, Any] = {
            "rank": r, "full_rank": full,
            "input_shape": _shapes(captured[0]) if captured else None,
            "dense_ms": None, "lowrank_ms": None, "speedup": None,
            "params_dense": before, "params_lowrank": after, "param_saving_share": share,
        }
        measurements[name] = m
        if after >= before:
            m["decision"] = "keep"
            m["reason"] = f"kept: no parameter saving at rank {r} ({after:,} >= {before:,})"
            keep_names.append(name)
            continue
        if captured is None:
            big = share >= min_param_share
            m["decision"] = "factorize" if big else "keep"
            m["reason"] = (f"not called by example_input; saves {share:.2%} of parameters "
                           f"({'>=' if big else '<'} min_param_share {min_param_share:.2%})")
            if not big:
                keep_names.append(name)
            continue
        variants = _kernel_variants(cls.from_dense(module, r, extra_bn=extra_bn))
        dense_ms, *low_times = _time_steps([copy.deepcopy(module), *variants.values()],
                                           *captured, repeats, warmup)
        if len(variants) > 1:  # judged by its fastest kernel, which the recipe will run
            m["kernel_ms"] = dict(zip(variants, low_times, strict=True))
        low_ms = min(low_times)
        speedup = dense_ms / low_ms if low_ms > 0 else math.inf
        m.update(dense_ms=dense_ms, lowrank_ms=low_ms, speedup=speedup)
        faster, big = speedup >= min_speedup, share >= min_param_share
        if faster or big:
            m["decision"] = "factorize"
            why = ([f"speedup {speedup:.2f}x >= {min_speedup:.2f}x"] if faster else []) + (
                [f"saves {share:.2%} of parameters >= {min_param_share:.2%}"] if big else [])
            m["reason"] = "factorized: " + " and ".join(why)
        else:
            m["decision"] = "keep"
            m["reason"] = (f"kept: speedup {speedup:.2f}x < {min_speedup:.2f}x and saves only "
                           f"{share:.2%} of parameters < {min_param_share:.2%}")
            keep_names.append(name)
    if max_params is not None:
        _fit_budget(keep_names, measurements, total, max_params)
    return keep_names, measurements


def time_kernels(model: nn.Module, example_input: Any, repeats: int = 5,
                 warmup: int = 2) -> dict[str, dict[str, Any]]:
    """Time every low-rank layer of ``model`` that has several kernels, with each kernel.

    Why: the kernels of a layer (``LowRankLSTM``'s fused and loop kernels) compute the same
    function at very different costs depending on the device and the sizes (see
    :mod:`pufferfish.lowrank.lstm`); like ``cudnn.benchmark``, the only reliable choice is a
    measurement on the shapes the run uses. Forward + backward in train mode on the input each
    layer receives from ``example_input``, interleaved, median of ``repeats``. Nothing is
    changed: the caller runs ``module.use_kernel(name)`` (the recipe does, with rank 0's answer,
    so that every replica runs the same kernel).

    Returns:
        name -> ``{"kernel": fastest, "<kernel>_ms": ...}`` (``{"kernel", "fused_ms", "loop_ms"}``
        for a LowRankLSTM), for each such layer that ``example_input`` reaches; ties go to the
        first of ``kernel_options()``.
    """
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, LowRankModule) and len(m.kernel_options()) > 1}
    inputs = _capture_inputs(model, example_input, list(layers.values())) if layers else {}
    found: dict[str, dict[str, Any]] = {}
    for name, module in layers.items():
        captured = inputs.get(id(module))
        if captured is None:
            continue
        variants = _kernel_variants(module)
        times = dict(zip(variants, _time_steps(list(variants.values()), *captured, repeats,
                                               warmup), strict=True))
        found[name] = {"kernel": min(times, key=times.__getitem__),
                       **{f"{kernel}_ms": ms for kernel, ms in times.items()}}
    return found


time_lstm_kernels = time_kernels  # its name when LowRankLSTM was the only layer with two kernels


def _kernel_variants(layer: LowRankModule) -> dict[str | None, LowRankModule]:
    """Kernel name -> a copy of ``layer`` running it; ``{None: layer}`` for a one-kernel layer."""
    variants: dict[str | None, LowRankModule] = {}
    for kernel in layer.kernel_options():
        variants[kernel] = copy.deepcopy(layer)
        variants[kernel].use_kernel(kernel)
    return variants or {None: layer}


def _fit_budget(keep_names: list[str], measurements: dict[str, dict[str, Any]], total: int,
                max_params: int) -> None:
    """Un-keep timed layers, highest speed-up first, until the factorized model has <= max_params."""
    after = total - sum(m["params_dense"] - m["params_lowrank"] for m in measurements.values()
                        if m["decision"] == "factorize")
    timed = sorted((n for n in keep_names if measurements[n]["speedup"] is not None),
                   key=lambda n: -measurements[n]["speedup"])
    for name in timed:
        if after <= max_params:
            break
        m = measurements[name]
        after -= m["params_dense"] - m["params_lowrank"]
        m["decision"] = "factorize"
        m["reason"] = (f"factorized: slower ({m['speedup']:.2f}x), but kept full-rank the model "
                       f"would exceed the parameter budget of {max_params:,}")
        keep_names.remove(name)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, found.append)
    return found


def _shapes(args: tuple[Any, ...]) -> list[list[int]] | None:
    shapes = [list(t.shape) for t in _tensors(args)]
    return shapes or None


def _capture_inputs(model: nn.Module, example_input: Any, modules: list[nn.Module]
                    ) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
    """id(module) -> the (args, kwargs) of its first call, as detached leaves.

    Run with gradients on (so that the tensors that need an input gradient in training are
    known, and so that no-grad fast paths such as the fused Transformer layer do not bypass the
    submodules) but in eval mode.
    """
    captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(module) not in captured:
            captured[id(module)] = (_map_tensors(args, leaf), _map_tensors(kwargs, leaf))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.enable_grad():
            call_with_example(model, example_input)
    finally:
        for h in handles:
            h.remove()
        for m, training in flags:
            m.training = training
    return captured


def _time_steps(layers: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
                repeats: int, warmup: int) -> list[float]:
    """Median milliseconds of one forward + backward step of each layer, timed interleaved."""
    for layer in layers:
        layer.train()
    leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    device = next(layers[0].parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    def step(layer: nn.Module) -> None:
        for p in layer.parameters():
            p.grad = None
        for t in leaves:
            t.grad = None
        outs = [t for t in _tensors(layer(*args, **kwargs)) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    def run(layer: nn.Module, number: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(number):
            step(layer)
        sync(device)
        return time.perf_counter() - start

    with torch.enable_grad():
        for _ in range(max(0, warmup)):
            for layer in layers:
                step(layer)
        single = max(max(run(layer, 1) for layer in layers), 1e-7)
        number = max(1, min(1000, math.ceil(_MIN_REPEAT_S / single)))
        times: list[list[float]] = [[] for _ in layers]
        for _ in range(repeats):
            for layer, record in zip(layers, times, strict=True):
                record.append(run(layer, number) / number)
    return [statistics.median(record) * 1e3 for record in times]


# --------------------------------------------------------------------------------------------
# Frobenius decay
# --------------------------------------------------------------------------------------------

def frobenius_decay(model: nn.Module, coeff: float) -> torch.Tensor:
    """``coeff/2 · Σ ‖U V‖²_F`` over the factor pairs of every low-rank layer of ``model``.

    Why (Khodak et al., ICLR 2021): plain weight decay on the factors penalizes
    ``‖U‖²_F + ‖V‖²_F``, which depends on how the product is split between them and, at the
    minimum over splits, equals ``2‖UV‖_*``: it pushes the *nuclear norm* of the product down,
    shrinking the rank further during training. Penalizing the product, ``‖UV‖²_F``, is exactly
    what weight decay did on the dense layer. Add the returned scalar to the loss and remove the
    factors (:func:`frobenius_decay_params`) from the optimizer's weight decay.

    Scaling: ``coeff/2`` (not ``coeff``), so that ``coeff`` means what an optimizer's
    ``weight_decay`` means: the gradient of ``coeff/2 ‖W‖²`` is ``coeff · W``. Here
    ``∂/∂U = coeff · (UV) Vᵀ`` and ``∂/∂V = coeff · Uᵀ (UV)``; reuse the dense model's weight decay
    (e.g. 1e-4 for ResNet on CIFAR) as a starting point.

    Cost: ``‖UV‖²_F = tr((UᵀU)(VVᵀ))`` uses two ``r x r`` Gram matrices (``O((m+n)r²)``), never
    the ``m x n`` product. An extra BatchNorm between conv factors is not part of the product.
    A shared module counts once. With no low-rank layer, the result is a zero scalar.
    """
    terms: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, LowRankModule):
            for left, right in module.factor_pairs():
                # both Gram matrices are symmetric, so tr(A B) = Σ_ij A_ij B_ij
                terms.append((left.mT @ left * (right @ right.mT)).sum())
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return torch.stack(terms).sum() * (coeff / 2)


def frobenius_decay_params(model: nn.Module) -> list[nn.Parameter]:
    """The factor weights of every low-rank layer: exclude them from plain weight decay.

    These are the parameters behind ``factor_pairs()`` (``u``/``v`` weights, LSTM ``u_*``/``v_*``);
    biases and extra BatchNorm parameters are not factors and keep the caller's treatment.
    Typical use::

        factors = {id(p) for p in frobenius_decay_params(model)}
        groups = [{"params": [p for p in model.parameters() if id(p) not in factors]},
                  {"params": [p for p in model.parameters() if id(p) in factors],
                   "weight_decay": 0.0}]
        loss = criterion(out, y) + frobenius_decay(model, coeff=wd)
    """
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, LowRankModule):
            continue
        params = list(module.parameters())
        for pair in module.factor_pairs():
            for t in pair:
                p = _owner(t, params)
                if p is None:
                    raise RuntimeError(f"a factor of {type(module).__name__} is not a view of one "
                                       "of its parameters")
                found[id(p)] = p
    return list(found.values())


def _owner(t: torch.Tensor, params: list[nn.Parameter]) -> nn.Parameter | None:
    """The parameter ``t`` is (a view of): the parameter itself, or whose memory holds ``t``'s start."""
    for p in params:
        if t is p:
            return p
    start = t.data_ptr()
    for p in params:
        same = p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        if same and p.data_ptr() <= start < p.data_ptr() + p.numel() * p.element_size():
            return p
    return None
