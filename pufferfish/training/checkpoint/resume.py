"""Finding the resume point: the newest checkpoint that verifies and loads, newest first."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import CheckpointError, CheckpointWarning, UnsafeCheckpointError
from .files import ckpt_dir, pt_name, scan
from .load import load_checkpoint


def _candidates(directory: Path) -> Iterator[Path]:
    pts, manifests = scan(directory)
    for s in sorted(pts | manifests, reverse=True):
        yield directory / pt_name(s)


def find_latest(
    run_dir: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> tuple[tuple[dict[str, Any], Path] | None, list[tuple[Path, str]]]:
    """The newest complete, verified checkpoint (or None), and the newer ones rejected on the way.

    Each rejected checkpoint comes with why (truncated, no manifest, checksum mismatch,
    unreadable archive), in one line that names the file. Nothing is removed or moved: what to do
    with a rejected file is the caller's decision. A file that passes its checksum but is refused
    as not plain-weights raises :class:`UnsafeCheckpointError` (tampering or a bug, not a crash).
    """
    rejected: list[tuple[Path, str]] = []
    for pt_path in _candidates(ckpt_dir(run_dir)):
        try:
            return (load_checkpoint(pt_path, map_location=map_location), pt_path), rejected
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            rejected.append((pt_path, str(exc)))
    return None, rejected


def latest_checkpoint(
    run_dir: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> tuple[dict[str, Any], Path] | None:
    """Return ``(state, path)`` of the newest complete, verified checkpoint, or None.

    Checkpoints that are incomplete or corrupt (truncated, manifest missing or not
    matching, checksum mismatch, unreadable archive) are skipped with one
    :class:`CheckpointWarning` naming each skipped file and the file used instead: a
    crash during a save must not stop the run from resuming from the previous one.

    A file that passes its checksum but is refused as not plain-weights raises
    :class:`UnsafeCheckpointError` instead: that is tampering or a bug, not a crash,
    and silently resuming from an older checkpoint would hide it.
    """
    found, rejected = find_latest(run_dir, map_location=map_location)
    skipped = "; ".join(f"{path} ({why})" for path, why in rejected)
    if rejected and found is not None:
        warnings.warn(
            f"skipped incomplete/corrupt checkpoint(s) {skipped}; resuming from {found[1]} instead",
            CheckpointWarning,
            stacklevel=2,
        )
    elif rejected:
        warnings.warn(
            f"no usable checkpoint in {ckpt_dir(run_dir)}: skipped {skipped}",
            CheckpointWarning,
            stacklevel=2,
        )
    return found
