"""Which modules a list of name patterns selects: the one index of a model's qualified names.

Every API that takes module patterns reads them the same way (``factorize``'s ``keep``,
``include`` and ``overrides``; the automatic recipe's ``keep`` and ``ranks``; the pruning
baselines' ``exclude``):

- a pattern is an ``fnmatch`` glob on qualified module names, case-sensitive, where ``*`` also
  crosses dots (``layer1.*`` matches ``layer1.0.conv1``);
- a module reachable under several names (a shared module) matches when any of its names does;
- a pattern that matches no name of the model is an error, so that a typo never silently leaves a
  layer full-rank (or pruned);
- where several patterns could decide for one module (``overrides``, ``ranks``), the first
  matching pattern, in the order given, wins; an ``int`` value is a rank, a ``float`` a ratio of
  the layer's full rank (:func:`resolve_rank`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from .svd import rank_from_ratio

__all__ = ["ModuleIndex", "as_patterns", "first_match", "resolve_rank"]


class ModuleIndex:
    """Every qualified name of every module of ``model`` (built once, read many times)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self._names.setdefault(id(module), []).append(name)

    def names(self, module: nn.Module) -> list[str]:
        """Every name ``module`` is reachable under, in registration order (the first is its name)."""
        return self._names[id(module)]

    def name(self, module: nn.Module) -> str:
        """The name reports and checkpoints use: the first in registration order."""
        return self._names[id(module)][0]

    def check(self, patterns: Iterable[str]) -> None:
        """Raise ``ValueError`` naming the first pattern that matches no module name."""
        every = [n for names in self._names.values() for n in names]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in every):
                raise ValueError(f"pattern {pattern!r} matches no module of "
                                 f"{type(self.model).__name__}")

    def first_match(self, module: nn.Module, patterns: Iterable[str]) -> str | None:
        """The first of ``patterns`` that matches one of ``module``'s names, or ``None``."""
        return first_match(self.names(module), patterns)

    def select(self, patterns: Iterable[str]) -> set[str]:
        """The names (first names) of the modules any pattern matches; each pattern must match."""
        patterns = as_patterns(patterns)
        self.check(patterns)
        return {names[0] for names in self._names.values()
                if first_match(names, patterns) is not None}


def as_patterns(patterns: str | Iterable[str]) -> list[str]:
    """A single pattern or an iterable of them, as a list (a ``str`` is one pattern, not letters)."""
    return [patterns] if isinstance(patterns, str) else list(patterns)


def first_match(names: Iterable[str], patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` that matches one of ``names``, or ``None``."""
    names = list(names)
    return next((p for p in patterns if any(fnmatch.fnmatchcase(n, p) for n in names)), None)


def resolve_rank(value: int | float, full_rank: int) -> int:
    """A layer's rank from an ``int`` rank (capped at ``full_rank``) or a ``float`` ratio of it."""
    return min(full_rank, value) if isinstance(value, int) else rank_from_ratio(full_rank, value)
