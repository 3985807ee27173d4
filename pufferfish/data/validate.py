"""Checks every image loader shares: split and dataset names, directories, label ranges.

Each raises a one-line :class:`DataError` naming the bad value and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from .errors import DataError

Split = Literal["train", "test"]

IMAGE_DATASETS = ("fashion-mnist", "cifar10")
_ALIASES = {
    "fashion-mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar-10": "cifar10",
}


def check_split(split: str) -> Split:
    """Return ``split`` if it is ``train`` or ``test``."""
    if split not in ("train", "test"):
        raise DataError(f"unknown split {split!r}; expected 'train' or 'test'")
    return split  # type: ignore[return-value]


def canonical_image_name(name: str) -> str:
    """The canonical name (one of :data:`IMAGE_DATASETS`) of an image dataset or its alias."""
    key = _ALIASES.get(name.strip().lower().replace("_", "-"))
    if key is None:
        raise DataError(
            f"unknown image dataset {name!r}; expected one of {', '.join(IMAGE_DATASETS)}"
        )
    return key


def check_dir(data_dir: str | os.PathLike[str], what: str, hint: str) -> Path:
    """``data_dir`` as a Path, if it is an existing directory (``hint``: what it should hold)."""
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"{path}: {what} directory does not exist; expected it to hold {hint}")
    return path


def check_subset(key: str, value: int, size: int, what: str) -> None:
    """``train_subset``/``test_subset`` ``value`` within the ``size`` examples or tokens there
    are (``what``: "the training tokens of kjv"): else a ``DataError`` naming the key."""
    if value > size:
        raise DataError(f"{key} {value} is invalid: allowed 0 (all) to {size} ({what})")


def missing_file(name: str, allowed: str) -> DataError | None:
    """The error for a ``data`` name that is a path (a folder in it, or a suffix) to no file;
    ``allowed`` says what the caller takes there."""
    path = Path(name).expanduser()
    if path.is_file() or (len(path.parts) < 2 and not path.suffix):
        return None
    what = "is a directory" if path.is_dir() else "does not exist"
    return DataError(f"data {name!r} {what}: allowed {allowed}")


def check_labels(labels: np.ndarray, path: Path, num_classes: int) -> None:
    """Refuse a label outside ``0..num_classes - 1`` (``path``: the file it came from)."""
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        bad = int(labels.max()) if int(labels.max()) >= num_classes else int(labels.min())
        raise DataError(f"{path}: label value {bad} out of range; expected 0..{num_classes - 1}")
