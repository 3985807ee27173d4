"""The training methods by ``--mode``: a registry filled without importing any method.

The registry itself is :mod:`pufferfish.modes` (the configuration checks ``mode`` against it): the
built-in modes are named by where their class lives and imported when first built, so the loop
(which knows only :class:`Method`) imports no method, and a method's module imports only the
interface: no cycle. Another method joins with :func:`register_method` (one file defining a
:class:`Method` subclass, and one call).
"""

from __future__ import annotations

from collections.abc import Callable

from ... import modes
from ...config import TrainConfig
from .base import Change, Method

__all__ = ["Change", "Method", "build_method", "method_names", "register_method"]


def register_method(mode: str, factory: Callable[[TrainConfig], Method]) -> None:
    """Make ``--mode MODE`` train with ``factory(cfg)`` (replacing a built-in of that name); the
    configuration accepts the mode from then on."""
    modes.register_mode(mode, factory)


def method_names() -> list[str]:
    return modes.mode_names()


def build_method(cfg: TrainConfig) -> Method:
    """The method of ``cfg.mode``; ValueError naming the allowed modes."""
    factory = modes.method_factory(cfg.mode)
    if factory is None:
        raise ValueError(f"mode {cfg.mode!r} is invalid: allowed {', '.join(method_names())}")
    return factory(cfg)
