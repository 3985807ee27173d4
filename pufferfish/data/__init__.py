"""Datasets for Pufferfish experiments: decoded once into tensors, batched without per-sample work.

This package knows nothing about models or training. Entry point: :func:`load_dataset`.

Default locations: Fashion-MNIST ``/usr/share/datasets/fashion-mnist``; CIFAR-10
``./data/cifar-10-batches-py`` (create with ``download("cifar10", "data")``); KJV from the
``bible`` program (package ``bible-kjv``). Every bad input raises :class:`DataError`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .bpe import BPECorpus, load_bpe_corpus
from .errors import DataError
from .images import (
    CIFAR10_CLASSES,
    DEFAULT_CIFAR10_DIR,
    DEFAULT_FASHION_DIR,
    FASHION_MNIST_CLASSES,
    IMAGE_DATASETS,
    NORMALIZATION,
    ImageDataset,
    TensorImageLoader,
    clear_cache,
    download,
    load_cifar10,
    load_fashion_mnist,
    load_image_dataset,
    random_crop_flip,
    read_idx,
)
from .packed import PackedLoader
from .text import (
    EOS,
    BPTTLoader,
    Corpus,
    SplitMode,
    Vocab,
    batchify,
    get_bptt_batch,
    load_kjv,
    load_text_file,
    split_lines,
    tokenize,
)
from .validate import missing_file

__all__ = [
    "CIFAR10_CLASSES",
    "DATASET_NAMES",
    "DEFAULT_CIFAR10_DIR",
    "DEFAULT_FASHION_DIR",
    "EOS",
    "FASHION_MNIST_CLASSES",
    "NORMALIZATION",
    "BPECorpus",
    "BPTTLoader",
    "Corpus",
    "DataError",
    "ImageDataset",
    "PackedLoader",
    "TensorImageLoader",
    "Vocab",
    "batchify",
    "clear_cache",
    "download",
    "get_bptt_batch",
    "load_bpe_corpus",
    "load_cifar10",
    "load_dataset",
    "load_fashion_mnist",
    "load_image_dataset",
    "load_kjv",
    "load_text_file",
    "missing_file",
    "random_crop_flip",
    "read_idx",
    "split_lines",
    "tokenize",
]

DATASET_NAMES = (*IMAGE_DATASETS, "kjv")
_TEXT_ALIASES = {"kjv", "bible"}
_IMAGE_ALIASES = {"fashion-mnist", "fashionmnist", "fmnist", "cifar10", "cifar-10"}


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    valid_frac: float = 0.05,
    test_frac: float = 0.05,
    split_mode: SplitMode = "interleaved",
) -> ImageDataset | Corpus:
    """Load a dataset by name: an :class:`ImageDataset` or a text :class:`Corpus`.

    ``name`` is ``fashion-mnist``, ``cifar10``, ``kjv`` (case/underscore-insensitive), or a path
    to a UTF-8 text file. ``data_dir`` (``None``: the default) applies to image datasets;
    ``cache_dir`` optionally keeps decoded image tensors as ``.pt`` files; the ``*_frac`` and
    ``split_mode`` arguments apply to text corpora (see :func:`split_lines`).
    """
    key = name.strip().lower().replace("_", "-")
    if key in _IMAGE_ALIASES:
        return load_image_dataset(key, data_dir, cache_dir=cache_dir)
    split = {"valid_frac": valid_frac, "test_frac": test_frac, "split_mode": split_mode}
    if key in _TEXT_ALIASES:
        return Corpus.from_lines(load_kjv(), source="kjv", **split)  # type: ignore[arg-type]
    path = Path(name).expanduser()
    if path.is_file():
        return Corpus.from_file(path, **split)  # type: ignore[arg-type]
    raise missing_file(
        name, f"an existing UTF-8 text file or one of {', '.join(DATASET_NAMES)}") or DataError(
        f"unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)} "
        "or a path to an existing UTF-8 text file"
    )

