"""The manifest beside each payload: its size and SHA-256, written after the payload is in place.

"A manifest exists and matches" means "this checkpoint is complete": a payload without one
(killed between the two renames) is incomplete. Verifying needs no unpickling, so truncation or
bit rot is reported as such rather than as a confusing unpickling error.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ...formatting import one_line
from .errors import CheckpointError, describe_failure
from .files import manifest_path

MANIFEST_FORMAT = "pufferfish-checkpoint"
MANIFEST_VERSION = 1


def manifest_bytes(pt_path: Path, step: int, size: int, sha256: str) -> bytes:
    """The manifest vouching for the payload ``pt_path`` of ``step`` (``size`` bytes)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "file": pt_path.name,
        "step": step,
        "size": size,
        "sha256": sha256,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
    }
    return (json.dumps(manifest, indent=1) + "\n").encode()


def _sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        size = f.tell()
    return digest.hexdigest(), size


def verify_manifest(pt_path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``pt_path`` matches its manifest (size, SHA-256)."""
    path = manifest_path(pt_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{pt_path} has no manifest {path.name} (write interrupted?)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read manifest {path}: {describe_failure(exc)}") from exc
    try:
        manifest = json.loads(raw)
        expected_size = int(manifest["size"])
        expected_sha = str(manifest["sha256"]).lower()
        ok = manifest.get("format") == MANIFEST_FORMAT and manifest.get("file") == pt_path.name
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"manifest {path} is corrupt: {one_line(str(exc), limit=200)}") from exc
    if not ok:
        raise CheckpointError(f"manifest {path} does not describe {pt_path.name}")
    try:
        actual_size = pt_path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{pt_path} is missing (manifest {path.name} exists)") from None
    if actual_size != expected_size:
        raise CheckpointError(
            f"{pt_path} is {actual_size} bytes, manifest says {expected_size} (truncated?)"
        )
    actual_sha, _ = _sha256_file(pt_path)
    if actual_sha != expected_sha:
        raise CheckpointError(f"{pt_path} fails its SHA-256 check (corrupted)")


def rejection(pt_path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint ``pt_path`` does not verify (size, SHA-256, manifest), or None if it does.

    A checksum check only, without unpickling: enough to tell a checkpoint the program wrote and
    vouched for from a crash artifact or a damaged file, which callers set aside instead of
    deleting.
    """
    try:
        verify_manifest(Path(pt_path))
    except CheckpointError as exc:
        return str(exc)
    return None
