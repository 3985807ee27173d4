"""CIFAR-10: its files, classes and checksum, loaded from the python pickle batches.

Batches are unpickled by an unpickler that can only rebuild numpy arrays, so a tampered
download cannot run code.
"""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..formatting import one_line
from .cache import cached
from .errors import DataError
from .validate import Split, check_labels, check_split

DEFAULT_CIFAR10_DIR = Path("data") / "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_DIRNAME = "cifar-10-batches-py"

CIFAR_FILES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
# Official checksum (same value torchvision verifies against).
CIFAR10_MD5: dict[str, str] = {CIFAR10_ARCHIVE: "c58f30108f718f92721af3b95e74349a"}
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


def load_cifar10(
    data_dir: str | os.PathLike[str] = DEFAULT_CIFAR10_DIR,
    split: Split = "train",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load CIFAR-10 from the python batch directory as ``(uint8 N×3×32×32, int64 N)``.

    ``data_dir`` may be ``cifar-10-batches-py`` itself or its parent. Batches are unpickled with
    a numpy-only unpickler, so a tampered file cannot run code.
    """
    split = check_split(split)
    directory = _cifar_dir(data_dir)
    paths = [directory / name for name in CIFAR_FILES[split]]
    for p in paths:
        if not p.is_file():
            raise DataError(
                f"{p}: missing CIFAR-10 batch; expected data_batch_1..5 and test_batch in {directory}"
            )
    return cached("cifar10", split, paths, lambda: _decode(paths), cache_dir)


def _cifar_dir(data_dir: str | os.PathLike[str]) -> Path:
    path = Path(data_dir).expanduser()
    if (path / CIFAR10_DIRNAME).is_dir():
        path = path / CIFAR10_DIRNAME
    if not path.is_dir():
        raise DataError(
            f"{path}: CIFAR-10 directory does not exist; expected {CIFAR10_DIRNAME} with data_batch_1..5 "
            f"and test_batch (fetch it: --download, or pufferfish.data.download('cifar10', "
            f"{str(data_dir)!r}))"
        )
    return path


def _decode(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [_load_batch(p) for p in paths]
    data = np.concatenate([b[0] for b in batches]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([b[1] for b in batches])
    return torch.from_numpy(data), torch.from_numpy(labels)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild numpy arrays/dtypes/scalars (what CIFAR batches hold).

    Plain ``pickle.load`` on a downloaded file can execute arbitrary code; this refuses any
    global other than numpy's array reconstruction helpers.
    """

    _ALLOWED = frozenset(
        {
            ("_codecs", "encode"),  # bytes pickled by Python 3 at protocol <= 2
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy._core.numeric", "_frombuffer"),  # protocol 5
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        canonical = (
            "numpy._core." + module[len("numpy.core.") :]
            if module.startswith("numpy.core.")
            else module
        )
        if (canonical, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is forbidden")
        try:
            mod = importlib.import_module(canonical)
        except ImportError:  # numpy < 2 has no numpy._core
            mod = importlib.import_module(canonical.replace("numpy._core", "numpy.core", 1))
        return getattr(mod, name)


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as ``(uint8 N×3072 data, int64 N labels)``, every field checked."""
    obj = _unpickle(path)
    data = _batch_data(path, obj.get(b"data", obj.get("data")))
    labels = _batch_labels(path, obj.get(b"labels", obj.get("labels")), len(data))
    check_labels(labels, path, 10)
    return data, labels


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # untrusted bytes can fail in many ways; all mean "bad file"
        raise DataError(
            f"{path}: cannot unpickle CIFAR-10 batch ({one_line(e, with_type=True)}); expected a pickled dict"
        ) from e
    if not isinstance(obj, dict):
        raise DataError(f"{path}: CIFAR-10 batch is a {type(obj).__name__}; expected a dict")
    return obj


def _batch_data(path: Path, data: Any) -> np.ndarray:
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
    ):
        desc = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise DataError(f"{path}: b'data' is {desc}; expected a uint8 array of shape N×3072")
    return data


def _batch_labels(path: Path, labels: Any, n: int) -> np.ndarray:
    try:
        labels_arr = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise DataError(
            f"{path}: b'labels' is not a list of ints ({one_line(e, with_type=True)}); expected N ints"
        ) from e
    if labels_arr.shape != (n,):
        raise DataError(
            f"{path}: {n} images but labels have shape {labels_arr.shape}; expected ({n},)"
        )
    return labels_arr
