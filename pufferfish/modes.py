"""The ``--mode`` names and where each training method lives: one registry for config and loop.

``TrainConfig`` checks ``mode`` against :func:`mode_names` and the loop builds the method with
:func:`method_factory`, so a method registered with
:func:`pufferfish.training.methods.register_method` is a valid ``--mode`` everywhere at once. The
built-in methods are named by module path and imported only when built: this module imports
nothing of the package, so every layer may ask it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["BUILT_IN", "method_factory", "mode_names", "register_mode"]

BUILT_IN: dict[str, str] = {
    "full": "pufferfish.method:FullRankMethod",
    "pufferfish": "pufferfish.method:PufferfishMethod",
    "lowrank": "pufferfish.method:PufferfishMethod",  # Pufferfish without warm-up
    "lth": "pufferfish.baselines.lth:LotteryTicketMethod",
    "prune": "pufferfish.baselines.slimming:SlimmingMethod",
    "galore": "pufferfish.baselines.galore:GaLoreMethod",  # full rank, GaLore's optimizer
}
_REGISTERED: dict[str, Callable[[Any], Any]] = {}


def register_mode(mode: str, factory: Callable[[Any], Any]) -> None:
    """Make ``mode`` build its method with ``factory(cfg)`` (replacing a built-in of that name)."""
    _REGISTERED[mode] = factory


def mode_names() -> list[str]:
    """Every mode, built-in and registered, in the order they were added."""
    return list(dict.fromkeys([*BUILT_IN, *_REGISTERED]))


def method_factory(mode: str) -> Callable[[Any], Any] | None:
    """The factory of ``mode`` (a built-in's class, imported now), or None if there is none."""
    if mode in _REGISTERED:
        return _REGISTERED[mode]
    if mode in BUILT_IN:
        module, _, name = BUILT_IN[mode].partition(":")
        return getattr(importlib.import_module(module), name)
    return None
