"""Comparing a checkpoint's saved records (architecture, config) with this run's, leaf by leaf."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ...formatting import one_line
from .errors import CheckpointError

_MAX_REPORTED = 3

_MISSING = object()


def _flatten(d: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        # Configs round-tripped through JSON turn tuples into lists; that is not a change.
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        fa, fb = _flatten(a), _flatten(b)
        return fa.keys() == fb.keys() and all(_equal(fa[k], fb[k]) for k in fa)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if (type(a) is bool) != (type(b) is bool):
        return False  # True == 1 in Python, but a flag that became a rank is a change
    try:
        return bool(a == b)
    except Exception:
        return False


def _show(v: Any) -> str:
    return "<absent>" if v is _MISSING else one_line(repr(v), limit=60)


def verify_compatible(
    saved_arch: Mapping[str, Any], current_arch: Mapping[str, Any], what: str = "architecture"
) -> None:
    """Raise :class:`CheckpointError` if two records (e.g. architectures) differ.

    Resuming low-rank weights into a model whose factorization differs fails deep in
    ``load_state_dict`` with shape errors, or worse, silently with a different rank
    schedule; comparing the saved record first gives a message naming the culprit.
    Nested dicts are compared leaf by leaf (keys joined with "."); the first
    few differing keys are named with both values, in the saved record's order.
    """
    saved, current = _flatten(saved_arch), _flatten(current_arch)
    diffs: list[str] = []
    for key in [*saved, *(k for k in current if k not in saved)]:
        a, b = saved.get(key, _MISSING), current.get(key, _MISSING)
        if a is _MISSING or b is _MISSING or not _equal(a, b):
            diffs.append(f"{key}: checkpoint has {_show(a)}, this run has {_show(b)}")
    if diffs:
        more = f"; and {len(diffs) - _MAX_REPORTED} more" if len(diffs) > _MAX_REPORTED else ""
        raise CheckpointError(
            f"{what} mismatch between checkpoint and this run: "
            f"{'; '.join(diffs[:_MAX_REPORTED])}{more}"
        )
