"""Image datasets by name (Fashion-MNIST, CIFAR-10): both splits as uint8 tensors, plus loaders.

This module bundles what a model and a loader need to know about a dataset (:class:`ImageDataset`)
and re-exports the image API; each concern has its own module: :mod:`.idx` (IDX files),
:mod:`.fashion` and :mod:`.cifar` (the datasets), :mod:`.download`, :mod:`.cache` (decoded
tensors) and :mod:`.loader` (batches).

Defaults (override with ``data_dir``):

* Fashion-MNIST: ``/usr/share/datasets/fashion-mnist`` holding the four IDX files
  (``*.gz`` or ungzipped).
* CIFAR-10: ``./data/cifar-10-batches-py`` (relative to the working directory), the
  directory the official python tarball extracts to; its parent directory is accepted too.
  ``download("cifar10", "data")`` creates it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import clear_cache
from .cifar import CIFAR10_ARCHIVE as CIFAR10_ARCHIVE
from .cifar import CIFAR10_CLASSES, CIFAR10_URL, DEFAULT_CIFAR10_DIR, load_cifar10
from .cifar import CIFAR10_DIRNAME as CIFAR10_DIRNAME
from .cifar import CIFAR10_MD5 as CIFAR10_MD5
from .download import download
from .errors import DataError
from .fashion import (
    DEFAULT_FASHION_DIR,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_URL,
    load_fashion_mnist,
)
from .fashion import FASHION_MNIST_MD5 as FASHION_MNIST_MD5
from .idx import IDX_IMAGES_MAGIC as IDX_IMAGES_MAGIC
from .idx import IDX_LABELS_MAGIC as IDX_LABELS_MAGIC
from .idx import read_idx
from .loader import TensorImageLoader, random_crop_flip
from .validate import IMAGE_DATASETS, Split, canonical_image_name, check_split

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_URL",
    "DEFAULT_CIFAR10_DIR",
    "DEFAULT_FASHION_DIR",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_URL",
    "IMAGE_DATASETS",
    "NORMALIZATION",
    "VALIDATION_SEED",
    "ImageDataset",
    "TensorImageLoader",
    "clear_cache",
    "download",
    "load_cifar10",
    "load_fashion_mnist",
    "load_image_dataset",
    "random_crop_flip",
    "read_idx",
]

# Per-channel (mean, std) of the [0, 1]-scaled training images. CIFAR-10 uses the constants of
# the Pufferfish reference code (kuangliu/pytorch-cifar), so accuracies are comparable.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
}

# The generator seed of the permutation that picks the validation images (:meth:`ImageDataset.
# hold_out`): fixed, not the run's seed, so every seed, method and rank holds out the same images.
VALIDATION_SEED = 20_240_601


@dataclass(frozen=True)
class ImageDataset:
    """Both splits of an image dataset plus what a model/loader needs to know about them; after
    :meth:`hold_out`, a validation split taken out of the training one too."""

    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...]
    crop_padding: int
    val_images: torch.Tensor | None = None  # held out of the training images (hold_out)
    val_labels: torch.Tensor | None = None

    def hold_out(self, n: int) -> ImageDataset:
        """This dataset with ``n`` training images moved to a validation split.

        They are the first ``n`` of a fixed permutation of the training split (generator seeded
        with :data:`VALIDATION_SEED`): the same images whatever the run's seed, method or number
        of processes, and never trained on. Both splits keep the file order (so ``--train-subset``
        takes the first examples of what remains). ``n`` 0: an empty validation split.
        """
        total = len(self.train_labels)
        if not 0 <= n < total:
            raise DataError(f"val_subset {n} is invalid: allowed 0 (none) to {total - 1} (the "
                            f"training images of {self.name}, less one to train on)")
        order = torch.randperm(total, generator=torch.Generator().manual_seed(VALIDATION_SEED))
        held = torch.zeros(total, dtype=torch.bool)
        held[order[:n]] = True
        train = (self.train_images[~held], self.train_labels[~held]) if n else \
            (self.train_images, self.train_labels)
        return dataclasses.replace(self, train_images=train[0], train_labels=train[1],
                                   val_images=self.train_images[held],
                                   val_labels=self.train_labels[held])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return self.train_images.shape[1]

    @property
    def image_size(self) -> tuple[int, int]:
        return (self.train_images.shape[2], self.train_images.shape[3])

    def loader(
        self,
        split: Split,
        batch_size: int,
        *,
        shuffle: bool | None = None,
        augment: bool | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        subset: int | None = None,
        drop_last: bool = False,
        device: torch.device | str | None = None,
    ) -> TensorImageLoader:
        """Build a loader; ``shuffle``/``augment`` default to on for train and off for test."""
        split = check_split(split)
        is_train = split == "train"
        images, labels = (
            (self.train_images, self.train_labels)
            if is_train
            else (self.test_images, self.test_labels)
        )
        return TensorImageLoader(
            images,
            labels,
            batch_size,
            mean=self.mean,
            std=self.std,
            shuffle=is_train if shuffle is None else shuffle,
            augment=is_train if augment is None else augment,
            crop_padding=self.crop_padding,
            seed=seed,
            rank=rank,
            world_size=world_size,
            subset=subset,
            drop_last=drop_last,
            device=device,
        )


Loader = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# name -> (split loader, default directory, class names, crop padding for augmentation)
_SOURCES: dict[str, tuple[Loader, os.PathLike[str], tuple[str, ...], int]] = {
    "fashion-mnist": (load_fashion_mnist, DEFAULT_FASHION_DIR, FASHION_MNIST_CLASSES, 2),
    "cifar10": (load_cifar10, DEFAULT_CIFAR10_DIR, CIFAR10_CLASSES, 4),
}


def load_image_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ImageDataset:
    """Load both splits of ``fashion-mnist`` or ``cifar10`` (``data_dir=None``: the default dir)."""
    key = canonical_image_name(name)
    load_split, default_dir, classes, padding = _SOURCES[key]
    directory = default_dir if data_dir is None else data_dir
    train = load_split(directory, "train", cache_dir=cache_dir)
    test = load_split(directory, "test", cache_dir=cache_dir)
    mean, std = NORMALIZATION[key]
    return ImageDataset(key, train[0], train[1], test[0], test[1], mean, std, classes, padding)
