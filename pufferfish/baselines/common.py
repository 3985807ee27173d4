"""Helpers the pruning baselines share: which module is the output layer, glob matching."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

__all__ = ["match_modules", "output_layer_name"]


def output_layer_name(model: nn.Module) -> str:
    """The qualified name of the model's output layer: its last ``nn.Linear`` in registration order.

    Both baselines leave the classifier alone (Frankle & Carbin prune it at a lower rate; network
    slimming cannot remove a class), and for the paper's models the last Linear *is* the classifier
    (``fc`` of ResNet-18, ``classifier.fc3`` of VGG-19-BN, also the last entry of their preset
    ``keep`` lists).
    """
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear output layer to exclude")
    return names[-1]


def match_modules(model: nn.Module, patterns: Iterable[str]) -> set[str]:
    """Names of the modules matching any glob in ``patterns``; a pattern matching none is an error.

    The same rule as :func:`pufferfish.lowrank.factorize`'s patterns, so that a typo in an exclude
    list is an error instead of a silently pruned classifier.
    """
    names = [name for name, _ in model.named_modules() if name]
    hits: set[str] = set()
    for pattern in patterns:
        matched = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not matched:
            raise ValueError(f"pattern {pattern!r} matches no module of {type(model).__name__}")
        hits |= matched
    return hits
