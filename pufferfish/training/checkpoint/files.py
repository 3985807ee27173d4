"""Where the checkpoints of a run directory live and what their files are called.

``run_dir/checkpoints/ckpt-{step:09d}.pt`` (payload), ``ckpt-{step:09d}.json`` (its manifest),
hidden ``.ckpt-....<host>.<pid>.<hex>.tmp`` files while a write is under way, and
``checkpoints/rejected/`` for checkpoints set aside.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path

from .errors import CheckpointError

CHECKPOINT_SUBDIR = "checkpoints"
REJECTED_SUBDIR = "rejected"  # under CHECKPOINT_SUBDIR: checkpoints set aside, never deleted

PT_RE = re.compile(r"^ckpt-(\d{9,})\.pt$")
JSON_RE = re.compile(r"^ckpt-(\d{9,})\.json$")
DCP_RE = re.compile(r"^ckpt-(\d{9,})\.dcp$")
TMP_RE = re.compile(
    r"^\.(?P<final>ckpt-\d{9,}\.(?:pt|json|dcp))\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$"
)


def ckpt_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINT_SUBDIR


def pt_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def manifest_path(pt_path: Path) -> Path:
    return pt_path.with_suffix(".json")


def dcp_path(pt_path: Path) -> Path:
    """The sharded part of a checkpoint (FSDP2 runs): a directory beside its payload."""
    return pt_path.with_suffix(".dcp")


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """Return the step encoded in a checkpoint file name (``ckpt-000001200.pt`` -> 1200).

    Lets the training loop resume its step counter from the path returned by
    :func:`latest_checkpoint` without storing it twice.
    """
    m = PT_RE.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"{path} is not a checkpoint file name (expected ckpt-NNNNNNNNN.pt)")
    return int(m.group(1))


def host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def temp_path(final: Path) -> Path:
    # Hidden and ending in .tmp so no reader glob ever matches it; host + pid let a later
    # save recognise (and remove) temps orphaned by a killed writer.
    return final.parent / f".{final.name}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def scan(directory: Path) -> tuple[set[int], set[int]]:
    """Return (steps with a payload, steps with a manifest)."""
    pts: set[int] = set()
    manifests: set[int] = set()
    if not directory.is_dir():
        return pts, manifests
    for entry in directory.iterdir():
        if m := PT_RE.match(entry.name):
            pts.add(int(m.group(1)))
        elif m := JSON_RE.match(entry.name):
            manifests.add(int(m.group(1)))
    return pts, manifests


def checkpoint_files(run_dir: str | os.PathLike[str], *, temps: bool = False) -> list[Path]:
    """The checkpoint files (payloads and manifests) in ``run_dir``, verified or not, by step.

    With ``temps``, also the hidden temp files of interrupted writes. Never anything under
    ``checkpoints/rejected/`` nor files of other names.
    """
    directory = ckpt_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if PT_RE.match(p.name) or JSON_RE.match(p.name) or DCP_RE.match(p.name)
                  or (temps and TMP_RE.match(p.name)))
