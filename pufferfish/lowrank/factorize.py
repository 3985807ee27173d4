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
5. the rank: the first matching ``overrides`` pattern (an ``int`` is a rank, a ``float`` a ratio),
   else ``rank``, else ``rank_ratio`` of the layer's full rank; capped at the full rank;
6. no parameter saving at that rank (``r·(m+n) ≥ m·n``) -> kept;
7. otherwise replaced by ``LowRankX.from_dense(module, rank)``.

Modules inside a candidate (the ``out_proj`` of an ``nn.MultiheadAttention``) or inside an
existing low-rank module are never candidates themselves, so factorizing twice is a no-op. A module
reachable under several names (a shared module) is replaced under every name by one low-rank
module, so it stays shared.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .base import LowRankModule, low_rank_class_for
from .lstm import LowRankLSTM
from .svd import rank_from_ratio

__all__ = [
    "FactorizationReport",
    "LayerDecision",
    "count_macs",
    "factorizable_modules",
    "factorize",
    "merge",
]


@dataclass
class LayerDecision:
    """What ``factorize`` did with one module, and why."""

    name: str
    kind: str
    shape: str
    factorized: bool
    reason: str
    rank: int | None = None
    full_rank: int | None = None
    params_before: int = 0
    params_after: int = 0
    aliases: list[str] = field(default_factory=list)


@dataclass
class FactorizationReport:
    """Per-module decisions plus whole-model parameter (and, given an input, MAC) counts."""

    layers: list[LayerDecision]
    params_before: int
    params_after: int
    macs_before: int | None = None
    macs_after: int | None = None

    @property
    def factorized(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.factorized]

    @property
    def ranks(self) -> dict[str, int]:
        """Qualified name -> rank of every factorized module (what a checkpoint must record)."""
        return {d.name: d.rank for d in self.layers if d.factorized and d.rank is not None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        rows = [("module", "type", "shape", "rank", "params", "decision")]
        for d in self.layers:
            rank = f"{d.rank}/{d.full_rank}" if d.factorized else "-"
            params = (f"{d.params_before:,} -> {d.params_after:,}" if d.factorized
                      else f"{d.params_before:,}")
            name = d.name + (f" (= {', '.join(d.aliases)})" if d.aliases else "")
            rows.append((name, d.kind, d.shape, rank, params, d.reason))
        lines = format_table(rows)
        ratio = self.params_before / max(1, self.params_after)
        lines.append(f"parameters: {self.params_before:,} -> {self.params_after:,} ({ratio:.2f}x fewer)")
        if self.macs_before is not None and self.macs_after is not None:
            ratio = self.macs_before / max(1, self.macs_after)
            lines.append(f"MACs:       {self.macs_before:,} -> {self.macs_after:,} ({ratio:.2f}x fewer)")
        return "\n".join(lines)


def format_table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    """Aligned plain-text columns, a dashed rule under the header row (the first)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return lines


def count_params(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, example_input: Any) -> int:
    """Multiply-accumulates of one forward pass (``FlopCounterMode`` FLOPs / 2), in eval mode.

    Eval mode so that counting does not update BatchNorm statistics; the training flags of every
    submodule are restored afterwards. Two blind spots of the flop counter are covered: the fused
    fast path of ``nn.MultiheadAttention``/``TransformerEncoderLayer`` is switched off while
    counting (so attention is counted as its matmuls, like training runs it), and ``nn.LSTM``'s
    fused kernel, which the counter does not see, is counted analytically: per time step and layer
    ``4h·(in + h)`` MACs. A :class:`LowRankLSTM` is counted as its factorized arithmetic (its loop
    kernel, run while counting), whichever kernel it trains with: the fused kernel is an execution
    choice made by timing, not a different model.
    """
    flags = [(m, m.training) for m in model.modules()]
    lstm_macs = [0]

    def count_lstm(module: nn.LSTM, args: tuple, output: Any) -> None:
        x = args[0]
        steps = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
        h, width = module.hidden_size, module.input_size
        for _ in range(module.num_layers):
            lstm_macs[0] += steps * 4 * h * (width + h)
            width = h

    handles = [m.register_forward_hook(count_lstm) for m in model.modules()
               if type(m) is nn.LSTM]
    kernels = [(m, m.fused) for m in model.modules() if isinstance(m, LowRankLSTM)]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    model.eval()
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        for m, _ in kernels:
            m.fused = False
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            _call(model, example_input)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for m, fused in kernels:
            m.fused = fused
        for handle in handles:
            handle.remove()
        for m, training in flags:
            m.training = training
    return counter.get_total_flops() // 2 + lstm_macs[0]


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
            models in :mod:`pufferfish.models` define ``"paper"``); its ``keep`` patterns are added
            to ``keep``.
        extra_bn: put a BatchNorm between the two factors of each conv (the paper's variant).
        example_input: an input for ``model(example_input)`` (a tuple is unpacked); when given, the
            forward order is traced and the report carries MACs before and after.

    Every pattern must match at least one module name, so that a typo is an error rather than a
    silently full-rank layer.
    """
    if rank is None:
        rank_from_ratio(1, rank_ratio)  # validates the ratio, naming the bad value
    elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank {rank!r} is out of range: allowed an integer >= 1")
    if isinstance(keep_first, bool) or not isinstance(keep_first, int) or keep_first < 0:
        raise ValueError(f"keep_first {keep_first!r} is out of range: allowed an integer >= 0")
    keep = [keep] if isinstance(keep, str) else list(keep)
    if preset is not None:
        keep += _preset(model, preset).get("keep", [])
    include = None if include is None else ([include] if isinstance(include, str) else list(include))
    overrides = dict(overrides or {})
    for value in overrides.values():
        if isinstance(value, float):
            rank_from_ratio(1, value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"override {value!r} is invalid: allowed a rank (int >= 1) "
                             "or a ratio (float in (0, 1])")

    names_of = _names_by_module(model)
    all_names = [n for names in names_of.values() for n in names]
    for pattern in [*keep, *(include or []), *overrides]:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in all_names):
            raise ValueError(f"pattern {pattern!r} matches no module of {type(model).__name__}")

    candidates, unsupported = _candidates(model, names_of)
    order = _forward_order(model, candidates, example_input) if example_input is not None else candidates
    hybrid = {id(m) for m in order[:keep_first]}

    params_before = count_params(model)
    macs_before = count_macs(model, example_input) if example_input is not None else None
    decisions: list[LayerDecision] = []
    for module in candidates:
        names = names_of[id(module)]
        cls = low_rank_class_for(module)
        assert cls is not None
        decision = LayerDecision(name=names[0], aliases=names[1:], kind=type(module).__name__,
                                 shape=_shape(module), factorized=False, reason="",
                                 params_before=count_params(module))
        decisions.append(decision)
        hit = _first_match(names, keep)
        if hit is not None:
            decision.reason = f"kept: matches keep pattern {hit!r}"
            continue
        if include is not None and _first_match(names, include) is None:
            decision.reason = "kept: matches no include pattern"
            continue
        if id(module) in hybrid:
            decision.reason = f"kept: hybrid, among the first {keep_first} layers"
            continue
        why = cls.unsupported_reason(module)
        if why is not None:
            decision.reason = f"kept: {why}"
            continue
        full = cls.full_rank(module)
        decision.full_rank = full
        hit = _first_match(names, overrides)
        chosen = overrides[hit] if hit is not None else (rank if rank is not None else rank_ratio)
        r = min(full, chosen) if isinstance(chosen, int) else rank_from_ratio(full, chosen)
        decision.rank = r
        after = cls.params_at_rank(module, r)
        if after >= decision.params_before:
            decision.reason = (f"kept: no parameter saving at rank {r} "
                               f"({after:,} >= {decision.params_before:,})")
            continue
        low = cls.from_dense(module, r, extra_bn=extra_bn)
        low.train(module.training)
        for name in names:
            _replace(model, name, low)
        decision.factorized, decision.params_after = True, count_params(low)
        how = "ratio" if isinstance(chosen, float) else "rank"
        decision.reason = f"factorized ({how} {chosen}" + (f", override {hit!r})" if hit else ")")

    for module in unsupported:
        names = names_of[id(module)]
        decisions.append(LayerDecision(
            name=names[0], aliases=names[1:], kind=type(module).__name__, shape=_shape(module),
            factorized=False, reason="kept: unsupported type", params_before=count_params(module)))

    macs_after = count_macs(model, example_input) if example_input is not None else None
    return FactorizationReport(decisions, params_before, count_params(model), macs_before, macs_after)


def factorizable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module for every module ``factorize`` could replace, in registration order.

    The candidates of rules 1-7 (same subtree skipping: nothing inside a candidate or a low-rank
    module) minus those the layer class reports unsupported (rule 4), before any keep, include
    or parameter-saving rule. The name is the module's first qualified name, the one the report
    uses; a shared module appears once. Exact names are valid ``keep``/``overrides`` patterns.
    """
    names_of = _names_by_module(model)
    candidates, _ = _candidates(model, names_of)
    supported: dict[str, nn.Module] = {}
    for module in candidates:
        cls = low_rank_class_for(module)
        if cls is not None and cls.unsupported_reason(module) is None:
            supported[names_of[id(module)][0]] = module
    return supported


def merge(model: nn.Module) -> nn.Module:
    """Turn every low-rank module of ``model`` back into its dense equivalent, in place.

    Returns ``model`` (or the dense module when ``model`` itself is low-rank).
    """
    if isinstance(model, LowRankModule):
        return model.to_dense()
    modules = {id(m): m for m in model.modules() if isinstance(m, LowRankModule)}
    names_of = _names_by_module(model)
    for module_id, module in modules.items():
        dense = module.to_dense()
        dense.train(module.training)
        for name in names_of[module_id]:
            _replace(model, name, dense)
    return model


def _preset(model: nn.Module, preset: str) -> dict[str, Any]:
    presets = getattr(model, "PRESETS", None) or {}
    if preset not in presets:
        allowed = ", ".join(sorted(presets)) or "none: pass keep/include patterns instead"
        raise ValueError(f"{type(model).__name__} has no preset {preset!r}: allowed {allowed}")
    return presets[preset]


def _names_by_module(model: nn.Module) -> dict[int, list[str]]:
    """id(module) -> every qualified name it is reachable under, in registration order."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return names


def _candidates(model: nn.Module, names_of: dict[int, list[str]]
                ) -> tuple[list[nn.Module], list[nn.Module]]:
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


def _first_match(names: list[str], patterns: Iterable[str]) -> str | None:
    return next((p for p in patterns if any(fnmatch.fnmatchcase(n, p) for n in names)), None)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def _shape(module: nn.Module) -> str:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return "x".join(map(str, weight.shape))
    if isinstance(module, nn.LSTM):
        return f"{module.input_size}->{module.hidden_size} x{module.num_layers}"
    if isinstance(module, nn.MultiheadAttention):
        return f"embed {module.embed_dim}, {module.num_heads} heads"
    return "-"


def _call(model: nn.Module, example_input: Any) -> Any:
    return model(*example_input) if isinstance(example_input, tuple) else model(example_input)
