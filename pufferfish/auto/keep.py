"""Which layers stay full-rank: those that factorizing makes neither faster nor much smaller.

Each candidate is timed dense and low-rank on the input it really receives (:mod:`.timing`);
a layer is kept when it is not faster factorized and saves under ``min_param_share`` of the
model's parameters, within an optional parameter budget. The result is
``factorize(model, keep=names)``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..lowrank.base import low_rank_class_for
from ..lowrank.counting import count_params
from ..lowrank.factorize import factorizable_modules
from ..lowrank.selection import ModuleIndex, resolve_rank
from . import timing
from .kernels import kernel_variants

__all__ = ["profile_keep"]


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
    amp_dtype: torch.dtype | None = None,
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
    variants interleaved so that drift on a shared machine hits both. ``amp_dtype``: the run's
    autocast, each forward under it (the capture's too) as the run trains. The model is not
    modified.

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
    criteria = _Criteria(min_speedup, min_param_share, repeats, warmup, extra_bn, amp_dtype)
    chosen = _ranked_layers(model, ranks)
    inputs = timing.capture_inputs(model, example_input, [m for m, _ in chosen.values()],
                                   amp_dtype)
    total = count_params(model)
    measurements = {name: _measure(module, value, inputs.get(id(module)), total, criteria)
                    for name, (module, value) in chosen.items()}
    keep_names = [name for name, m in measurements.items() if m["decision"] == "keep"]
    if max_params is not None:
        _fit_budget(keep_names, measurements, total, max_params)
    return keep_names, measurements


@dataclass(frozen=True)
class _Criteria:
    """How :func:`profile_keep` times and judges each layer (its keyword arguments)."""

    min_speedup: float
    min_param_share: float
    repeats: int
    warmup: int
    extra_bn: bool
    amp_dtype: torch.dtype | None


def _ranked_layers(model: nn.Module, ranks: Mapping[str, int | float]
                   ) -> dict[str, tuple[nn.Module, int | float]]:
    """Name -> (module, rank or ratio) for each factorizable layer a key of ``ranks`` matches."""
    index = ModuleIndex(model)
    index.check(ranks)
    chosen: dict[str, tuple[nn.Module, int | float]] = {}
    for name, module in factorizable_modules(model).items():
        hit = index.first_match(module, ranks)
        if hit is not None:
            chosen[name] = (module, ranks[hit])
    return chosen


def _measure(module: nn.Module, value: int | float,
             captured: tuple[tuple[Any, ...], dict[str, Any]] | None, total: int,
             criteria: _Criteria) -> dict[str, Any]:
    """One layer's measurements and decision: on parameters alone, or timed."""
    cls = low_rank_class_for(module)
    assert cls is not None
    full = cls.full_rank(module)
    r = resolve_rank(value, full)
    before = count_params(module)
    after = cls.params_at_rank(module, r, extra_bn=criteria.extra_bn)
    share = (before - after) / max(1, total)
    m: dict[str, Any] = {
        "rank": r, "full_rank": full,
        "input_shape": timing.input_shapes(captured[0]) if captured else None,
        "dense_ms": None, "lowrank_ms": None, "speedup": None,
        "params_dense": before, "params_lowrank": after, "param_saving_share": share,
    }
    if after >= before:
        m.update(decision="keep",
                 reason=f"kept: no parameter saving at rank {r} ({after:,} >= {before:,})")
    elif captured is None:
        big = share >= criteria.min_param_share
        m.update(decision="factorize" if big else "keep",
                 reason=(f"not called by example_input; saves {share:.2%} of parameters "
                         f"({'>=' if big else '<'} min_param_share "
                         f"{criteria.min_param_share:.2%})"))
    else:
        m.update(_timed(module, cls.from_dense(module, r, extra_bn=criteria.extra_bn), captured,
                        criteria))
        m.update(_judged(m["speedup"], share, criteria))
    return m


def _timed(dense: nn.Module, low: nn.Module, captured: tuple[tuple[Any, ...], dict[str, Any]],
           criteria: _Criteria) -> dict[str, Any]:
    """Dense vs low-rank milliseconds per step; a layer with several kernels by its fastest."""
    variants = kernel_variants(low)
    dense_ms, *low_times = timing.time_steps([copy.deepcopy(dense), *variants.values()],
                                             *captured, criteria.repeats, criteria.warmup,
                                             criteria.amp_dtype)
    low_ms = min(low_times)
    timed: dict[str, Any] = {"dense_ms": dense_ms, "lowrank_ms": low_ms,
                             "speedup": dense_ms / low_ms if low_ms > 0 else math.inf}
    if len(variants) > 1:  # the recipe will run the fastest kernel
        timed["kernel_ms"] = dict(zip(variants, low_times, strict=True))
    return timed


def _judged(speedup: float, share: float, criteria: _Criteria) -> dict[str, str]:
    """Factorize if faster or saving enough parameters; else keep (with the reason)."""
    faster, big = speedup >= criteria.min_speedup, share >= criteria.min_param_share
    if faster or big:
        why = ([f"speedup {speedup:.2f}x >= {criteria.min_speedup:.2f}x"] if faster else []) + (
            [f"saves {share:.2%} of parameters >= {criteria.min_param_share:.2%}"] if big else [])
        return {"decision": "factorize", "reason": "factorized: " + " and ".join(why)}
    return {"decision": "keep",
            "reason": (f"kept: speedup {speedup:.2f}x < {criteria.min_speedup:.2f}x and saves "
                       f"only {share:.2%} of parameters < {criteria.min_param_share:.2%}")}


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
