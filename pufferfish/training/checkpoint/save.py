"""Writing a checkpoint: check the state, prepare the directory, payload, manifest, prune.

Each step is durable before the next, so a kill at any point leaves every *previous*
checkpoint intact and the new one either complete or recognisably incomplete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from .. import faults
from .atomic import atomic_write, fsync_dir
from .errors import CheckpointError, CheckpointWarning, describe_failure
from .files import TMP_RE, ckpt_dir, host_tag, manifest_path, pt_name, scan
from .manifest import manifest_bytes
from .safety import check_weights_only_safe
from .sharded import remove_sharded


def save_checkpoint(
    run_dir: str | os.PathLike[str], state: dict[str, Any], step: int, keep_last: int = 3
) -> Path:
    """Atomically write ``state`` as the checkpoint for ``step`` and prune old ones.

    Order of operations (each step durable before the next, so a kill at any point
    leaves every *previous* checkpoint intact and the new one either complete or
    recognisably incomplete):

    1. validate ``state`` loads with ``weights_only=True`` (see the package docstring);
    2. remove an existing manifest for the same ``step`` (re-save) so the old manifest
       never vouches for new bytes;
    3. ``torch.save`` to a temp file, fsync, rename to ``ckpt-{step:09d}.pt``, fsync dir;
    4. write the manifest (size + SHA-256) the same way;
    5. prune: keep the newest ``keep_last`` complete checkpoints (always including this
       one); checkpoints with a *larger* step than ``step`` are left alone.

    Raises :class:`CheckpointError` (naming the path and e.g. ``ENOSPC``) if writing
    fails; the temp files and any partial files for ``step`` are removed. Pruning
    failures only warn: the new checkpoint is already safe.
    """
    _check_arguments(state, step, keep_last)
    check_weights_only_safe(state)
    pt_path = ckpt_dir(run_dir) / pt_name(step)
    _prepare_directory(pt_path)
    _write_payload_and_manifest(pt_path, state, step)
    _prune(pt_path.parent, step, keep_last)
    return pt_path


def _check_arguments(state: Any, step: Any, keep_last: Any) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")


def _prepare_directory(pt_path: Path) -> None:
    """Create the directory (durably), remove orphaned temps and a re-saved step's manifest."""
    directory = pt_path.parent
    try:
        created = not directory.is_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(directory.parent)
        _remove_orphaned_temps(directory)
        old_manifest = manifest_path(pt_path)
        if old_manifest.exists():
            old_manifest.unlink()
            fsync_dir(directory)
    except OSError as exc:
        raise CheckpointError(
            f"cannot prepare checkpoint directory {directory}: {describe_failure(exc)}"
        ) from exc


def _write_payload_and_manifest(pt_path: Path, state: dict[str, Any], step: int) -> None:
    """The payload, then its manifest; on failure neither is left behind for ``step``."""
    current = pt_path
    try:
        size, sha256 = _write_payload(pt_path, state, step)
        faults.strike("save-manifest", step)
        current = manifest_path(pt_path)
        atomic_write(current, lambda f: f.write(manifest_bytes(pt_path, step, size, sha256)))
    except Exception as exc:
        _remove_partial(pt_path)
        raise CheckpointError(
            f"failed to write checkpoint {current}: {describe_failure(exc)}"
        ) from exc


class _HashingWriter:
    """File-like wrapper that hashes and counts bytes as ``torch.save`` writes them.

    Avoids re-reading a multi-GB checkpoint just to compute its checksum.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += view.nbytes
        return n if n is not None else view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _write_payload(pt_path: Path, state: dict[str, Any], step: int) -> tuple[int, str]:
    """``torch.save`` ``state`` atomically to ``pt_path``; its size and SHA-256, hashed as written."""
    hashed: list[_HashingWriter] = []

    def write(f: IO[bytes]) -> None:
        writer = _HashingWriter(f)
        hashed.append(writer)
        torch.save(state, writer)  # type: ignore[arg-type]
        faults.strike("save-payload", step)

    atomic_write(pt_path, write)
    return hashed[0].size, hashed[0].sha256.hexdigest()


def _remove_partial(pt_path: Path) -> None:
    # A payload without a manifest is useless; remove it so it neither wastes the
    # space that just ran out nor triggers "skipped incomplete" warnings later.
    for p in (manifest_path(pt_path), pt_path):
        with contextlib.suppress(OSError):
            p.unlink()
    remove_sharded(pt_path)
    with contextlib.suppress(OSError):
        fsync_dir(pt_path.parent)


def _remove_orphaned_temps(directory: Path) -> None:
    """Delete temp files left by killed writers on this host (their pid is gone)."""
    host = host_tag()
    for entry in directory.iterdir():
        m = TMP_RE.match(entry.name)
        if m is None or m.group("host") != host:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                entry.unlink()
        except OSError:
            pass  # alive but not ours (EPERM), or unknown: leave it


def _prune(directory: Path, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints up to ``step``; newer ones untouched."""
    pts, manifests = scan(directory)
    complete = sorted(s for s in pts & manifests if s <= step)
    keep = set(complete[-keep_last:]) | {step}
    doomed = sorted(s for s in pts | manifests if s < step and s not in keep)
    failed: list[str] = []
    for s in doomed:
        pt = directory / pt_name(s)
        # Manifest first: a crash mid-prune leaves an "incomplete" payload, never a
        # manifest vouching for a missing file.
        for p in (manifest_path(pt), pt):
            try:
                p.unlink(missing_ok=True)
            except OSError as exc:
                failed.append(f"{p} ({describe_failure(exc)})")
        remove_sharded(pt)
    if doomed:
        with contextlib.suppress(OSError):
            fsync_dir(directory)
    if failed:
        warnings.warn(
            f"could not prune old checkpoints: {', '.join(failed)}", CheckpointWarning, stacklevel=3
        )
