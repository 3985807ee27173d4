"""Reading IDX files (the Fashion-MNIST format), gzipped or not, with every header checked."""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ..formatting import one_line
from .errors import DataError

IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dims
IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dim


def read_idx(path: str | os.PathLike[str], expected_magic: int) -> np.ndarray:
    """Decode one IDX file (gzipped or not), validating magic number, dims and byte length.

    ``expected_magic`` is 2051 for image files and 2049 for label files.
    """
    path = Path(path)
    raw = _read_bytes(path)
    ndim = _check_magic(path, raw, expected_magic)
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(
            f"{path}: truncated IDX header ({len(raw)} bytes); expected {header} bytes for {ndim} dims"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    _check_length(path, len(raw), header, dims)
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":  # gzip magic: decide by content, not by file name
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(
            f"{path}: cannot read ({one_line(e, with_type=True)}); expected an intact, optionally gzipped IDX file"
        ) from e
    return raw


def _check_magic(path: Path, raw: bytes, expected_magic: int) -> int:
    """Check the 4-byte magic number and return the number of dims it declares."""
    if len(raw) < 4:
        raise DataError(
            f"{path}: truncated IDX file ({len(raw)} bytes); expected a 4-byte magic number"
        )
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        raise DataError(f"{path}: wrong IDX magic number {magic}; expected {expected_magic}")
    return raw[3]


def _check_length(path: Path, size: int, header: int, dims: tuple[int, ...]) -> None:
    expected = header + math.prod(dims)
    if size != expected:
        what = "truncated IDX file" if size < expected else "IDX file has trailing bytes"
        raise DataError(
            f"{path}: {what} ({size} bytes); expected {expected} bytes for shape {tuple(dims)}"
        )
