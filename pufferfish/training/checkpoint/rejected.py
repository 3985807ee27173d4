"""Setting a rejected checkpoint aside in ``checkpoints/rejected/``: moved, never deleted."""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import fsync_dir
from .files import REJECTED_SUBDIR, dcp_path, manifest_path


def set_aside(pt_path: str | os.PathLike[str]) -> list[Path]:
    """Move a rejected checkpoint (payload, manifest, sharded part: those that exist) into
    ``rejected/``.

    A run resuming from an older checkpoint will write the same step again; moving the rejected
    files first keeps them (for inspection: a bad copy, tampering, a crash) instead of replacing
    them. An earlier file of the same name there is not replaced either: the newcomer gets a
    numbered name. Returns the new paths.
    """
    pt_path = Path(pt_path)
    rejected = pt_path.parent / REJECTED_SUBDIR
    rejected.mkdir(exist_ok=True)
    sources = [p for p in (pt_path, manifest_path(pt_path), dcp_path(pt_path)) if p.exists()]
    n = 0
    while any((rejected / _numbered(p.name, n)).exists() for p in sources):
        n += 1
    moved = []
    for p in sources:
        target = rejected / _numbered(p.name, n)
        os.rename(p, target)
        moved.append(target)
    fsync_dir(rejected)
    fsync_dir(pt_path.parent)
    return moved


def _numbered(name: str, n: int) -> str:
    stem, dot, suffix = name.partition(".")
    return name if n == 0 else f"{stem}.{n}{dot}{suffix}"
