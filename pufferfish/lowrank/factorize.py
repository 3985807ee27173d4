"""Whole-model surgery: plan which modules become low-rank, apply it, report it.

``factorize`` works on any ``nn.Module`` tree. It never special-cases a layer type: the registry in
:mod:`pufferfish.lowrank.base` says which dense types have a low-rank replacement, and each class
answers whether an instance is supported, its full rank and its size at a given rank.

Rules, in the order they are applied to each candidate module (the first that fires decides):

1. matches a ``keep`` pattern (fnmatch glob on any of its qualified names; ``*`` crosses dots)
   -> kept;
2. ``include`` given and no include pattern matches -> kept;
3. among the first ``keep_first`` supported modules in *forward order* -> kept (the paper's
   hybrid network). Forward order is the order in which modules are first called during a forward
   pass of ``example_input`` when one is given (traced with forward pre-hooks), and registration
   order (``named_modules``) otherwise: the two agree for sequential models, not always for models
   whose ``forward`` calls children out of registration order;
4. the layer class reports the instance unsupported (grouped conv, bidirectional LSTM, ...) -> kept;
   so is a module whose weight a ``torch.nn.utils`` hook recomputes (``weight_norm``, ...);
5. one of its parameters is also held by a module outside it (a tied weight: GPT-2's ``lm_head``
   and ``wte``) -> kept, "weight tied to <name>": factorizing one holder would untie them;
6. its rank is the first matching ``overrides`` pattern (an ``int`` is a rank, a ``float`` a
   ratio), else ``rank``, else ``rank_ratio`` of the layer's full rank; capped at the full rank
   (:mod:`pufferfish.lowrank.selection`). No parameter saving at that rank (``params_at_rank``
   and, once built, the replacement's own count ≥ the dense count; ``extra_bn`` included)
   -> kept. So factorizing never enlarges a model;
7. otherwise replaced by ``LowRankX.from_dense(module, rank, extra_bn=...)``.

Modules inside a candidate (the ``out_proj`` of an ``nn.MultiheadAttention``) or inside an
existing low-rank module are never candidates themselves, so factorizing twice changes nothing (and
warns, naming the low-rank modules already there). A module reachable under several names (a
shared module) is replaced under every name by one low-rank module, so it stays shared.

The replacement takes over what the dense module carried: train/eval mode, ``requires_grad`` (a
frozen weight gives frozen factors), dtype, device, memory format (channels-last), and its
forward/backward hooks (the hook dictionaries themselves, so the user's handles still remove
them). ``factorize`` is all-or-nothing:
every replacement is built before the first is swapped in, and any error (including one in the
after-MACs forward pass) puts every original module back before it is raised. A model whose root
is itself a supported layer is an error (there is no parent to swap it in); a model where nothing
was factorized gets a warning that says why.

Around the walk: the report (:mod:`.report`), the counts (:mod:`.counting`), the all-or-nothing
swap (:mod:`.swap`) and the way back, ``merge`` and ``load_factorized`` (:mod:`.roundtrip`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from .base import LowRankModule, low_rank_class_for
from .counting import count_macs, count_params
from .presets import resolve_preset
from .report import FactorizationReport, LayerDecision
from .selection import ModuleIndex, as_patterns, first_match, resolve_rank
from .svd import rank_from_ratio
from .swap import carry_over, swapped

__all__ = ["factorizable_modules", "factorize"]

_HINT = "see pufferfish.register_low_rank"


def factorize(
    model: nn.Module,
    rank_ratio: float = 0.25,
    rank: int | None = None,
    keep: Iterable[str] = (),
    include: Iterable[str] | None = None,
    overrides: Mapping[str, int | float] | None = None,
    keep_first: int = 0,
    preset: str | None = None,
    extra_bn: bool = False,
    example_input: Any = None,
    materialize: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> FactorizationReport:
    """Replace the supported modules of ``model`` in place by low-rank ones; return the report.

    Args:
        rank_ratio: rank as a fraction of each layer's full rank, in (0, 1]; the paper uses 1/4.
        rank: one absolute rank for every layer (capped at each layer's full rank); wins over
            ``rank_ratio``.
        keep: glob patterns of qualified module names to keep full-rank.
        include: if given, only modules matching one of these patterns are factorized.
        overrides: pattern -> rank (int) or ratio (float) for the modules it matches.
        keep_first: keep the first K supported modules (forward order) full-rank: the paper's
            hybrid network, since the first layers are the most sensitive to factorization.
        preset: a named choice shipped with the model class in ``model.PRESETS`` (the paper's
            models in :mod:`pufferfish.models` define ``"paper"``) or registered for its class name
            (HF's ``LlamaForCausalLM``); ``"default"``: ``"paper"`` if the model has it, else none
            (:func:`~pufferfish.lowrank.presets.resolve_preset`). Its ``keep`` patterns are added
            to ``keep``.
        extra_bn: put a BatchNorm between the two factors of each conv (the paper's variant).
        example_input: what the model is called with (see :func:`call_with_example`: a tensor, a
            tuple of positional arguments or a dict of keyword arguments); when given, the
            forward order is traced and the report carries MACs before and after.
        materialize: gives a candidate its full weights while its replacement is built, one
            layer at a time (sharded models: :func:`pufferfish.distributed.fsdp.gathered`).

    Every pattern must match at least one module name, so that a typo is an error rather than a
    silently full-rank layer.
    """
    keep, include, overrides = _validated(model, rank_ratio, rank, keep, include, overrides,
                                          keep_first, preset)
    _check_root(model)
    index = ModuleIndex(model)
    index.check([*keep, *(include or []), *overrides])
    already_low_rank = _warn_if_already_low_rank(model, index)
    candidates, unsupported = find_candidates(model)
    order = candidates if example_input is None else _forward_order(model, candidates,
                                                                     example_input)
    plan = _Plan(keep=keep, include=include, overrides=overrides,
                 # a ratio even when written as an int (rank_ratio=1): an int is an absolute rank
                 default=rank if rank is not None else float(rank_ratio), keep_first=keep_first,
                 hybrid={id(m) for m in order[:keep_first]}, tied=_tied_parameters(model),
                 options={"extra_bn": extra_bn}, materialize=materialize)
    params_before = count_params(model)
    macs_before = count_macs(model, example_input) if example_input is not None else None

    decisions: list[LayerDecision] = []
    replacements: list[tuple[nn.Module, nn.Module, list[str]]] = []
    for module in candidates:
        decision, low = _decide(module, index.names(module), plan)
        decisions.append(decision)
        if low is not None:
            replacements.append((module, low, index.names(module)))
    decisions += [_unsupported_decision(m, index.names(m)) for m in unsupported]

    with swapped(model, replacements):
        macs_after = count_macs(model, example_input) if example_input is not None else None
    report = FactorizationReport(decisions, params_before, count_params(model), macs_before,
                                 macs_after)
    if not replacements and (decisions or not already_low_rank):
        _warn_nothing_factorized(model, decisions)
    return report


@dataclass
class _Plan:
    """The choices of one ``factorize`` call, applied to each candidate by :func:`_decide`."""

    keep: list[str]
    include: list[str] | None
    overrides: dict[str, int | float]
    default: int | float  # ``rank`` (an int) or ``rank_ratio`` (a float)
    keep_first: int
    hybrid: set[int]  # ids of the first ``keep_first`` modules in forward order
    tied: dict[int, list[tuple[nn.Module, str]]]
    options: dict[str, Any]
    materialize: Callable[[nn.Module], AbstractContextManager[Any]] | None = None


def _validated(model: nn.Module, rank_ratio: float, rank: int | None, keep: Iterable[str],
               include: Iterable[str] | None, overrides: Mapping[str, int | float] | None,
               keep_first: int, preset: str | None
               ) -> tuple[list[str], list[str] | None, dict[str, int | float]]:
    """Check the scalar arguments (naming a bad value); ``keep`` (with the preset's), ``include``
    and ``overrides`` as lists and a dict."""
    if rank is None:
        rank_from_ratio(1, rank_ratio)  # validates the ratio, naming the bad value
    elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank {rank!r} is out of range: allowed an integer >= 1")
    if isinstance(keep_first, bool) or not isinstance(keep_first, int) or keep_first < 0:
        raise ValueError(f"keep_first {keep_first!r} is out of range: allowed an integer >= 0")
    keep = as_patterns(keep)
    keep += resolve_preset(model, preset).get("keep", [])
    overrides = dict(overrides or {})
    for value in overrides.values():
        if isinstance(value, float):
            rank_from_ratio(1, value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"override {value!r} is invalid: allowed a rank (int >= 1) "
                             "or a ratio (float in (0, 1])")
    return keep, None if include is None else as_patterns(include), overrides


def _decide(module: nn.Module, names: list[str], plan: _Plan
            ) -> tuple[LayerDecision, LowRankModule | None]:
    """Rules 1-7 for one candidate: its report line, and its replacement unless it is kept."""
    cls = low_rank_class_for(module)
    assert cls is not None
    decision = LayerDecision(name=names[0], aliases=names[1:], kind=type(module).__name__,
                             shape=_shape(module), factorized=False, reason="",
                             params_before=count_params(module))
    why = _why_kept(module, names, cls, plan)
    if why is not None:
        decision.reason = f"kept: {why}"
        return decision, None
    decision.full_rank = cls.full_rank(module)
    hit = first_match(names, plan.overrides)
    chosen = plan.overrides[hit] if hit is not None else plan.default
    decision.rank = resolve_rank(chosen, decision.full_rank)
    with plan.materialize(module) if plan.materialize else nullcontext():
        low, after = _build_if_smaller(cls, module, decision.rank, decision.params_before,
                                       plan.options)
    if low is None:
        decision.reason = (f"kept: no parameter saving at rank {decision.rank} "
                           f"({after:,} >= {decision.params_before:,})")
        return decision, None
    carry_over(module, low)
    decision.factorized, decision.params_after = True, after
    how = "ratio" if isinstance(chosen, float) else "rank"
    decision.reason = f"factorized ({how} {chosen}" + (f", override {hit!r})" if hit else ")")
    return decision, low


def _why_kept(module: nn.Module, names: list[str], cls: type[LowRankModule], plan: _Plan
              ) -> str | None:
    """Rules 1-5: why ``module`` stays dense whatever its rank, or ``None``."""
    hit = first_match(names, plan.keep)
    if hit is not None:
        return f"matches keep pattern {hit!r}"
    if plan.include is not None and first_match(names, plan.include) is None:
        return "matches no include pattern"
    if id(module) in plan.hybrid:
        return f"hybrid, among the first {plan.keep_first} layers"
    return cls.unsupported_reason(module) or _reparametrized(module) or _tie(module, plan.tied)


def _build_if_smaller(cls: type[LowRankModule], module: nn.Module, rank: int, before: int,
                      options: dict[str, Any]) -> tuple[LowRankModule | None, int]:
    """Rules 6-7: the replacement at ``rank`` and its size, or ``None`` if it saves nothing.

    ``params_at_rank`` answers before anything is built; the built module's own count has the
    last word (a class whose estimate is low cannot make the model larger).
    """
    after = cls.params_at_rank(module, rank, **options)
    if after >= before:
        return None, after
    low = cls.from_dense(module, rank, **options)
    after = max(after, count_params(low))
    return (low if after < before else None), after


def _unsupported_decision(module: nn.Module, names: list[str]) -> LayerDecision:
    return LayerDecision(name=names[0], aliases=names[1:], kind=type(module).__name__,
                         shape=_shape(module), factorized=False,
                         reason=f"kept: unsupported type; {_HINT}",
                         params_before=count_params(module))


def factorizable_modules(model: nn.Module, keep: str | Iterable[str] = ()
                         ) -> dict[str, nn.Module]:
    """Qualified name -> module for every module ``factorize`` could replace, in registration order.

    The candidates of rules 1-7 (same subtree skipping: nothing inside a candidate or a low-rank
    module) minus those the layer class reports unsupported (rule 4) and those matching a
    ``keep`` pattern (rule 1; each pattern must match a module), before any include or
    parameter-saving rule. The name is the module's first qualified name, the one the report
    uses; a shared module appears once. Exact names are valid ``keep``/``overrides`` patterns.
    """
    keep = as_patterns(keep)
    index = ModuleIndex(model)
    index.check(keep)
    candidates, _ = find_candidates(model)
    supported: dict[str, nn.Module] = {}
    for module in candidates:
        cls = low_rank_class_for(module)
        if (cls is not None and cls.unsupported_reason(module) is None
                and index.first_match(module, keep) is None):
            supported[index.name(module)] = module
    return supported


def _check_root(model: nn.Module) -> None:
    """A root module that is itself a supported layer has no parent to be swapped into; weights
    on the meta device (``init_empty_weights``, an offloading ``device_map``) have no values to
    split."""
    meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise ValueError(f"parameter {meta!r} is on the meta device (no values to factorize): "
                         "allowed a model whose weights are loaded (not init_empty_weights, no "
                         "offloading device_map)")
    cls = low_rank_class_for(model)
    if cls is not None:
        raise ValueError(f"the model itself is a {type(model).__name__}: factorize replaces "
                         f"submodules in place, so wrap it (nn.Sequential(model)) or build the "
                         f"replacement yourself ({cls.__name__}.from_dense(model, rank))")


def _warn_if_already_low_rank(model: nn.Module, index: ModuleIndex) -> bool:
    low = [index.name(m) or "<root>" for m in model.modules() if isinstance(m, LowRankModule)]
    if low:
        listed = ", ".join(low[:5]) + (f" and {len(low) - 5} more" if len(low) > 5 else "")
        warnings.warn(f"{type(model).__name__} is already factorized: {len(low)} low-rank "
                      f"module(s) ({listed}) are left as they are", stacklevel=3)
    return bool(low)


def _warn_nothing_factorized(model: nn.Module, decisions: list[LayerDecision]) -> None:
    if not decisions:
        why = "no module with a weight matrix (or all are already low-rank)"
    else:
        counts = Counter(d.reason.removeprefix("kept: ").split(" (")[0].split(";")[0]
                         for d in decisions)
        hint = {"unsupported type": f"unsupported type ({_HINT}, docs/extending.md)"}
        why = "; ".join(f"{n} x {hint.get(reason, reason)}" for reason, n in counts.most_common())
    warnings.warn(f"factorize changed nothing in {type(model).__name__}: {why}", stacklevel=3)


def _tied_parameters(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every ``(module, qualified parameter name)`` that registers it."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            entry = (module, f"{module_name}.{name}" if module_name else name)
            if all(m is not module for m, _ in holders.get(id(p), [])):
                holders.setdefault(id(p), []).append(entry)
    return holders


def _tie(module: nn.Module, holders: dict[int, list[tuple[nn.Module, str]]]) -> str | None:
    """Why ``module`` must stay dense: one of its parameters is also held outside it."""
    inside = {id(m) for m in module.modules()}
    for name, p in module.named_parameters():
        outside = [qualified for m, qualified in holders.get(id(p), []) if id(m) not in inside]
        if outside:
            return f"{name} tied to {outside[0]}"
    return None


def _reparametrized(module: nn.Module) -> str | None:
    """A weight recomputed by a ``torch.nn.utils`` pre-hook (``weight_norm``, ``spectral_norm``)."""
    for hook in module._forward_pre_hooks.values():
        if type(hook).__module__.startswith("torch.nn.utils"):
            return f"weight recomputed by {type(hook).__name__} (torch.nn.utils)"
    return None


def find_candidates(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """Modules with a registered low-rank class, and unsupported modules that own a matrix.

    The subtree below a candidate or a low-rank module is skipped: its children are the parent's
    implementation (``MultiheadAttention.out_proj``) or already factors.
    """
    candidates: list[nn.Module] = []
    unsupported: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, LowRankModule):
            return
        if module is not model and low_rank_class_for(module) is not None:
            candidates.append(module)
            return
        if module is not model and any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            unsupported.append(module)
        for child in module.children():
            visit(child)

    seen: set[int] = set()
    visit(model)
    return candidates, unsupported


def _forward_order(model: nn.Module, candidates: list[nn.Module], example_input: Any
                   ) -> list[nn.Module]:
    order: list[nn.Module] = []
    handles = [m.register_forward_pre_hook(lambda m, _: order.append(m) if m not in order else None)
               for m in candidates]
    try:
        count_macs(model, example_input)  # any eval-mode, no-grad forward pass will do
    finally:
        for h in handles:
            h.remove()
    return order + [m for m in candidates if m not in order]


def _shape(module: nn.Module) -> str:
    """The report's shape column, as the layer class words it (the default for unsupported types)."""
    return (low_rank_class_for(module) or LowRankModule).shape_summary(module)
