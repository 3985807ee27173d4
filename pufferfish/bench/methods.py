"""The methods ``pufferfish bench`` measures, and a method with its own settings.

A ``--methods`` entry is a method of :data:`BENCH_METHODS`, optionally with settings of its own:
``METHOD:KEY=VALUE[:KEY=VALUE...]`` (``powersgd:rank=1``, ``pufferfish:rank_ratio=0.125``), so
that one bench measures several settings of one method in the same rounds, each baseline at its
best side by side. The keys a method takes come from what it runs, never from a list here: its
comm hook's options (:mod:`pufferfish.distributed.hooks`' registry) named without the hook's
prefix (``powersgd_rank`` -> ``rank``), ``rank_ratio`` where the model is factorized (and
GaLore's ranks), ``inner_steps`` for the DiLoCo methods. Each key stands for one flat setting
(``powersgd_rank``, ``rank_ratio``, ``inner_steps``) that the variant overrides for itself only
(:meth:`MethodSpec.applied`); every other entry keeps the global flag's value.

:class:`MethodSpec` is the one parser; its canonical :attr:`~MethodSpec.name` (the base, then the
settings in the order given, values normalized: ``rank=02`` -> ``rank=2``) is the method's name
everywhere: results.json rows, results.md, plots, the projection, ``--compute-ms`` keys. A
method without settings keeps its plain name.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..distributed.hooks import HookOption, all_hook_options, hook_family, hook_names

__all__ = ["BENCH_METHODS", "DILOCO_METHODS", "FSDP_METHODS", "FSDP_VERSIONS", "HOOK_DEFAULTS",
           "HOOK_OPTIONS", "MethodSpec", "base_of", "hook_for", "parallel_for",
           "parse_method_map", "setting_keys", "sync_for"]

# method -> (factorize the model?, comm hook): plain DDP, every registered comm hook, Pufferfish
# with plain all-reduce and with each hook (the two compose: a smaller model, then fewer bytes
# per parameter).
BENCH_METHODS: dict[str, tuple[bool, str]] = {
    "ddp": (False, "allreduce"),
    **{hook: (False, hook) for hook in hook_names() if hook != "allreduce"},
    "pufferfish": (True, "allreduce"),
    "galore": (False, "allreduce"),  # full-size gradients, GaLore's optimizer
    **{f"pufferfish+{hook}": (True, hook) for hook in hook_names() if hook != "allreduce"},
    "diloco": (False, "allreduce"),
    "pufferfish+diloco": (True, "allreduce"),
    "fsdp": (False, "allreduce"),
    "pufferfish+fsdp": (True, "allreduce"),
}
# Methods that synchronize with DiLoCo (`pufferfish train --sync diloco`), not DDP every step.
DILOCO_METHODS = ("diloco", "pufferfish+diloco")
# Methods that shard with FSDP2 (`pufferfish train --parallel fsdp`): bench/sharded.py.
FSDP_METHODS = ("fsdp", "pufferfish+fsdp")
FSDP_VERSIONS = {"ddp": "fsdp", "pufferfish": "pufferfish+fsdp"}  # what --parallel fsdp measures
# The hooks' options (flags --powersgd-rank, --topk-ratio, ...) and where the bench's defaults
# differ from training's: PowerSGD compresses from step 2, so that the timed steps compress.
HOOK_OPTIONS = all_hook_options()
HOOK_DEFAULTS: dict[str, Any] = {"powersgd_start_iter": 2}

SETTINGS_FORM = "METHOD or METHOD:KEY=VALUE[:KEY=VALUE...], e.g. powersgd:rank=1"


@dataclass(frozen=True)
class _Setting:
    """One key a method takes: the flat setting it overrides, its type and its allowed values."""

    flat: str
    kind: type
    allowed: str
    accepts: Callable[[Any], bool]


_RANK_RATIO = _Setting("rank_ratio", float, "a number in (0, 1]", lambda r: 0 < r <= 1)
_INNER_STEPS = _Setting("inner_steps", int, "an integer >= 1", lambda n: n >= 1)


def _hook_setting(option: HookOption) -> _Setting:
    return _Setting(option.key, option.kind, option.allowed, option.accepts)


@functools.cache
def setting_keys(base: str) -> dict[str, _Setting]:
    """The keys ``base`` (a method of :data:`BENCH_METHODS`) takes, in order: its hook's options
    without the hook's prefix, ``rank_ratio`` where it factorizes (or, GaLore, projects at the
    Pufferfish ranks), ``inner_steps`` for DiLoCo."""
    factorized, hook = BENCH_METHODS[base]
    family = hook_family(hook)
    keys = {o.key.removeprefix(f"{family.name}_"): _hook_setting(o) for o in family.options}
    if factorized or base == "galore":
        keys["rank_ratio"] = _RANK_RATIO
    if base in DILOCO_METHODS:
        keys["inner_steps"] = _INNER_STEPS
    return keys


def base_of(name: str) -> str:
    """The method a (canonical) name measures: ``powersgd:rank=2`` -> ``powersgd``."""
    return name.partition(":")[0].strip()


def _format(value: Any) -> str:
    """A value as canonical names print it: integers plainly, floats ``:g`` where that is exact."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


S = TypeVar("S")


@dataclass(frozen=True)
class MethodSpec:
    """A bench method and its own settings: ``base`` (a key of :data:`BENCH_METHODS`) and
    ``settings``, ``(key, value)`` pairs in the order given (keys of :func:`setting_keys`)."""

    base: str
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str, flag: str = "--methods") -> MethodSpec:
        """``METHOD[:KEY=VALUE...]`` as a spec; ``ValueError`` (one line) names the bad entry, key
        or value and what is allowed."""
        base, *parts = (p.strip() for p in text.strip().split(":"))
        if base not in BENCH_METHODS:
            raise ValueError(f"unknown method {base!r}" + (f" in {flag} entry {text!r}" if parts
                             else "") + f": allowed {', '.join(BENCH_METHODS)}")
        keys = setting_keys(base)
        allowed = ", ".join(keys) or "none (it has no settings)"
        settings: dict[str, Any] = {}
        for part in parts:
            key, sep, raw = (x.strip() for x in part.partition("="))
            if not sep or not key or not raw:
                raise ValueError(f"{flag} entry {text!r} is invalid: allowed {SETTINGS_FORM}")
            if key not in keys:
                raise ValueError(f"{flag} entry {text!r}: key {key!r} is invalid for {base}: "
                                 f"allowed {allowed}")
            if key in settings:
                raise ValueError(f"{flag} entry {text!r} sets {key!r} twice: allowed each key once")
            settings[key] = _value(text, flag, key, raw, keys[key])
        return cls(base, tuple(settings.items()))

    @property
    def name(self) -> str:
        """The canonical name: the base, then each ``KEY=VALUE`` in order, values normalized."""
        return ":".join([self.base, *(f"{k}={_format(v)}" for k, v in self.settings)])

    @property
    def factorized(self) -> bool:
        return BENCH_METHODS[self.base][0]

    @property
    def hook(self) -> str:
        return BENCH_METHODS[self.base][1]

    @property
    def flat(self) -> dict[str, Any]:
        """The flat settings this variant overrides: ``{"powersgd_rank": 1}``."""
        keys = setting_keys(self.base)
        return {keys[k].flat: v for k, v in self.settings}

    def applied(self, settings: S) -> S:
        """A copy of ``settings`` (the bench's config or the step worker's flags) with this
        variant's own values over the global ones; unchanged (the same object) without any."""
        if not self.settings:
            return settings
        out = copy.copy(settings)
        for key, value in self.flat.items():
            setattr(out, key, value)
        return out

    def with_base(self, base: str) -> MethodSpec:
        """The same settings on another method (``--parallel fsdp``'s version, a factorized
        method's full-rank phase), keeping those ``base`` takes."""
        keys = setting_keys(base)
        return MethodSpec(base, tuple((k, v) for k, v in self.settings if k in keys))


def _value(text: str, flag: str, key: str, raw: str, setting: _Setting) -> Any:
    """``raw`` as ``setting``'s type, checked; ``ValueError`` (one line) otherwise."""
    try:
        value = setting.kind(raw)
        ok = bool(setting.accepts(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{flag} entry {text!r}: {key} {raw!r} is invalid: allowed "
                         f"{setting.allowed}")
    return value


def hook_for(method: str) -> tuple[bool, str]:
    """``(factorized, hook name)`` of a benchmark method (settings allowed: ``powersgd:rank=2``);
    ``ValueError`` names the allowed ones."""
    spec = MethodSpec.parse(method)
    return spec.factorized, spec.hook


def sync_for(method: str) -> str:
    """The ``--sync`` of ``pufferfish train`` a bench method trains with."""
    return "diloco" if base_of(method) in DILOCO_METHODS else "ddp"


def parallel_for(method: str) -> str:
    """The ``--parallel`` of ``pufferfish train`` a bench method trains with."""
    return "fsdp" if base_of(method) in FSDP_METHODS else "ddp"


def parse_method_map(spec: str, flag: str, form: str, allowed: Sequence[str] | None,
                     described: str) -> dict[str, str]:
    """``"ddp=a,powersgd:rank=2=b"`` -> ``{canonical method: value}`` for a flag that takes one
    value per method: an entry's method is everything before its last ``=``.

    ``ValueError`` names the bad entry: not ``form`` (e.g. ``METHOD=RUN_DIR``), a method outside
    ``allowed`` (``described`` says which those are; None: any bench method), bad settings, or a
    method named twice."""
    found: dict[str, str] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        method, sep, value = (x.strip() for x in item.rpartition("="))
        if not sep or not method or not value:
            raise ValueError(f"{flag} entry {item!r} is invalid: allowed {form}")
        if base_of(method) not in BENCH_METHODS:
            raise ValueError(f"unknown method {base_of(method)!r} in {flag}: allowed {described}")
        name = MethodSpec.parse(method, flag).name
        if allowed is not None and name not in allowed:
            raise ValueError(f"unknown method {name!r} in {flag}: allowed {described}")
        if name in found:
            raise ValueError(f"{flag} names method {name!r} twice: allowed each method (with its "
                             "settings) once")
        found[name] = value
    return found
