"""Decoded image tensors kept once per process, and optionally once per machine as ``.pt`` files.

Entries are keyed by the source files' path/size/mtime, so a replaced source is re-decoded; a
stale or corrupt ``.pt`` file is just a miss, since the sources are authoritative.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..formatting import one_line
from .errors import DataError

Tensors = tuple[torch.Tensor, torch.Tensor]

_MEMORY_CACHE: dict[tuple[str, str, str], tuple[str, torch.Tensor, torch.Tensor]] = {}


def clear_cache() -> None:
    """Drop the decoded tensors kept in memory (e.g. to free RAM after building loaders)."""
    _MEMORY_CACHE.clear()


def cached(
    name: str,
    split: str,
    sources: Sequence[Path],
    decode: Callable[[], Tensors],
    cache_dir: str | os.PathLike[str] | None,
) -> Tensors:
    """Decode once per process (and optionally once per machine via ``cache_dir``).

    Clones are returned so callers may modify their tensors without corrupting the cache.
    """
    fp = _fingerprint(sources)
    key = (name, split, str(sources[0].parent.resolve()))
    hit = _MEMORY_CACHE.get(key)
    if hit is not None and hit[0] == fp:
        return hit[1].clone(), hit[2].clone()
    tensors = _load_disk_cache(cache_dir, name, split, fp) if cache_dir is not None else None
    if tensors is None:
        tensors = decode()
        if cache_dir is not None:
            _save_disk_cache(cache_dir, name, split, fp, tensors)
    _MEMORY_CACHE[key] = (fp, tensors[0], tensors[1])
    return tensors[0].clone(), tensors[1].clone()


def _fingerprint(paths: Sequence[Path]) -> str:
    parts = []
    for p in paths:
        st = p.stat()
        parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def _load_disk_cache(
    cache_dir: str | os.PathLike[str], name: str, split: str, fp: str
) -> Tensors | None:
    path = Path(cache_dir) / f"{name}-{split}.pt"
    if not path.is_file():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a stale or corrupt cache is just a miss; the sources are authoritative
        return None
    if (
        not isinstance(obj, dict)
        or obj.get("fingerprint") != fp
        or not isinstance(obj.get("images"), torch.Tensor)
        or not isinstance(obj.get("labels"), torch.Tensor)
    ):
        return None
    return obj["images"], obj["labels"]


def _save_disk_cache(
    cache_dir: str | os.PathLike[str], name: str, split: str, fp: str, tensors: Tensors
) -> None:
    """Write ``name-split.pt`` through a temp file and a rename: never half-written."""
    directory = Path(cache_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}-{split}.", suffix=".part")
    except OSError as e:
        raise DataError(
            f"{directory}: cannot write tensor cache ({one_line(e, with_type=True)}); expected a writable directory"
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"fingerprint": fp, "images": tensors[0], "labels": tensors[1]}, f)
        os.replace(tmp, directory / f"{name}-{split}.pt")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
