"""Fashion-MNIST: its files, classes and checksums, loaded from IDX files as uint8 tensors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .cache import cached
from .errors import DataError
from .idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from .validate import Split, check_dir, check_labels, check_split

DEFAULT_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

FASHION_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# Official checksums (same values torchvision verifies against).
FASHION_MNIST_MD5: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83fd310",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


def load_fashion_mnist(
    data_dir: str | os.PathLike[str] = DEFAULT_FASHION_DIR,
    split: Split = "train",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load Fashion-MNIST as ``(uint8 images N×1×28×28, int64 labels N)``.

    Raw bytes are kept (no float conversion) so the whole split costs 47 MB; normalization
    happens per batch in :class:`~pufferfish.data.loader.TensorImageLoader`.
    """
    split = check_split(split)
    directory = check_dir(data_dir, "Fashion-MNIST", "the four *-idx?-ubyte[.gz] files")
    img_path, lbl_path = (_find_idx(directory, stem) for stem in FASHION_FILES[split])
    return cached(
        "fashion-mnist",
        split,
        [img_path, lbl_path],
        lambda: _decode(img_path, lbl_path),
        cache_dir,
    )


def _find_idx(data_dir: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (data_dir / name).is_file():
            return data_dir / name
    raise DataError(
        f"{data_dir / (stem + '.gz')}: missing Fashion-MNIST file; expected {stem}.gz or {stem} "
        f"(fetch it: --download, or pufferfish.data.download('fashion-mnist', {str(data_dir)!r}))"
    )


def _decode(img_path: Path, lbl_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one split's image and label files and check that they belong together."""
    images = read_idx(img_path, IDX_IMAGES_MAGIC)
    labels = read_idx(lbl_path, IDX_LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{img_path}: images have shape {images.shape[1:]}; expected 28×28")
    if len(images) != len(labels):
        raise DataError(
            f"{img_path}: {len(images)} images but {lbl_path.name} has {len(labels)} labels; "
            "expected equal counts"
        )
    check_labels(labels, lbl_path, 10)
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
