"""Sharded checkpoints (FSDP2): ``torch.distributed.checkpoint`` beside the usual payload.

``ckpt-{step}.dcp/`` holds the sharded model and optimizer, each process writing its own shards
(nothing is gathered onto one process); the ``.pt`` payload written afterwards by rank 0 holds the
rest of the run (method, progress, per-rank states) and, under ``"sharded"``, the directory's name
and the size and SHA-256 of every file in it; its manifest, written last, vouches for the payload.
So the guarantees of the store carry over: the directory is written under a hidden temp name and
renamed when complete (atomic), every shard file is verified before loading (a corrupt or missing
one refuses the checkpoint in one line, see :func:`verify_sharded`), and it is pruned, set aside
or removed only together with its payload. DCP reshards on load: a checkpoint written by 2
processes loads on 1 and back.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .atomic import fsync_dir
from .errors import CheckpointError, describe_failure
from .files import ckpt_dir, dcp_path, manifest_path, pt_name, temp_path

__all__ = ["load_sharded", "save_sharded", "verify_sharded"]


def save_sharded(run_dir: str | os.PathLike[str], step: int, state: dict[str, Any],
                 is_main: bool) -> dict[str, Any]:
    """Every rank: write ``state`` (DTensor state dicts) as ``ckpt-{step}.dcp``; returns the
    record for the payload's ``"sharded"`` entry (on every rank). A collective."""
    final = dcp_path(ckpt_dir(run_dir) / pt_name(step))
    tmp: Any = None
    if is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        # Re-saving a step: its old manifest goes first, so that it never vouches for new bytes.
        manifest_path(final.with_suffix(".pt")).unlink(missing_ok=True)
        tmp = str(temp_path(final))
    import torch.distributed.checkpoint as dcp  # where sharding is (see distributed.fsdp.is_dtensor)

    holder = [tmp]
    dist.broadcast_object_list(holder, src=0)
    tmp = Path(holder[0])
    dcp.save(state, checkpoint_id=tmp)
    record: list[Any] = [None]
    if is_main:
        try:
            files = {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(tmp.iterdir())}
            fsync_dir(tmp)
            if final.exists():  # the same step written again (a resumed run): ours to replace
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            record = [{"dir": final.name, "files": files}]
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            record = [f"failed to write checkpoint {final}: {describe_failure(exc)}"]
    dist.broadcast_object_list(record, src=0)
    if isinstance(record[0], str):
        raise CheckpointError(record[0])
    return record[0]


def verify_sharded(pt_path: Path, record: Any) -> None:
    """Raise :class:`CheckpointError` unless every file of the sharded part matches its record."""
    try:
        directory = pt_path.parent / record["dir"]
        files = dict(record["files"])
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{pt_path} has a corrupt 'sharded' record") from None
    if directory != dcp_path(pt_path):
        raise CheckpointError(f"{pt_path} names sharded directory {record['dir']!r}, expected "
                              f"{dcp_path(pt_path).name}")
    for name, (size, sha) in files.items():
        path = directory / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (sharded checkpoint {pt_path.name})") from None
        if actual != size:
            raise CheckpointError(f"{path} is {actual} bytes, the checkpoint says {size} "
                                  "(truncated?)")
        if _sha256(path) != sha:
            raise CheckpointError(f"{path} fails its SHA-256 check (corrupted)")


def load_sharded(pt_path: Path, record: Any, state: dict[str, Any]) -> None:
    """Every rank: fill ``state`` (DTensor state dicts of this run's sharding) from the sharded
    part of checkpoint ``pt_path``, verified first. A collective."""
    import torch.distributed.checkpoint as dcp

    verify_sharded(pt_path, record)
    try:
        dcp.load(state, checkpoint_id=pt_path.parent / record["dir"])
    except Exception as exc:  # DCP wraps each rank's failure in a CheckpointException
        raise CheckpointError(f"{dcp_path(pt_path)} does not fit this model: "
                              f"{describe_failure(exc)}") from exc


def remove_sharded(pt_path: Path) -> None:
    """Remove the sharded part of ``pt_path`` (pruning, or a failed write of its payload)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(dcp_path(pt_path))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
