"""The training methods by ``--mode``: a registry filled without importing any method.

The built-in modes are named by where their class lives and imported when first built, so the
loop (which knows only :class:`Method`) imports no method, and a method's module imports only the
interface: no cycle. Another method joins with :func:`register_method` (one file defining a
:class:`Method` subclass, and one call).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ...config import TrainConfig
from .base import Change, Method

__all__ = ["Change", "Method", "build_method", "method_names", "register_method"]

_BUILT_IN: dict[str, str] = {
    "full": "pufferfish.method:FullRankMethod",
    "pufferfish": "pufferfish.method:PufferfishMethod",
    "lowrank": "pufferfish.method:PufferfishMethod",  # Pufferfish without warm-up
    "lth": "pufferfish.baselines.lth:LotteryTicketMethod",
    "prune": "pufferfish.baselines.slimming:SlimmingMethod",
}
_REGISTERED: dict[str, Callable[[TrainConfig], Method]] = {}


def register_method(mode: str, factory: Callable[[TrainConfig], Method]) -> None:
    """Make ``--mode MODE`` train with ``factory(cfg)`` (replacing a built-in of that name)."""
    _REGISTERED[mode] = factory


def method_names() -> list[str]:
    return sorted({*_BUILT_IN, *_REGISTERED})


def build_method(cfg: TrainConfig) -> Method:
    """The method of ``cfg.mode``; ValueError naming the allowed modes."""
    factory = _REGISTERED.get(cfg.mode)
    if factory is None and cfg.mode in _BUILT_IN:
        module, _, name = _BUILT_IN[cfg.mode].partition(":")
        factory = getattr(importlib.import_module(module), name)
    if factory is None:
        raise ValueError(f"mode {cfg.mode!r} is invalid: allowed {', '.join(method_names())}")
    return factory(cfg)
