"""Tests for pufferfish.data: real Fashion-MNIST/KJV, synthetic IDX/CIFAR files, loopback downloads."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import pickle
import re
import shutil
import struct
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from pufferfish import data as pd
from pufferfish.data import (
    BPTTLoader,
    Corpus,
    DataError,
    TensorImageLoader,
    batchify,
    download,
    get_bptt_batch,
    load_cifar10,
    load_dataset,
    load_fashion_mnist,
    load_text_file,
    random_crop_flip,
    split_lines,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    pd.clear_cache()
    yield
    pd.clear_cache()


# ----------------------------------------------------------------------------- helpers


def idx_bytes(magic: int, arr: np.ndarray) -> bytes:
    return struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()


def write_idx(path: Path, magic: int, arr: np.ndarray, gz: bool = True) -> Path:
    raw = idx_bytes(magic, arr)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def make_fashion_dir(
    root: Path, n_train: int = 12, n_test: int = 5, gz: bool = True
) -> dict[str, tuple]:
    """Write a tiny Fashion-MNIST directory; images encode their index in pixel (0, 0)."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        imgs = np.random.default_rng(n).integers(0, 256, (n, 28, 28), dtype=np.uint8)
        imgs[:, 0, 0] = np.arange(n)
        labels = (np.arange(n) % 10).astype(np.uint8)
        img_stem, lbl_stem = FASHION_STEMS[split]
        suffix = ".gz" if gz else ""
        write_idx(root / (img_stem + suffix), 2051, imgs, gz)
        write_idx(root / (lbl_stem + suffix), 2049, labels, gz)
        out[split] = (imgs, labels)
    return out


def cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"batch",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [b"x.png"] * n,
    }


def make_cifar_dir(root: Path, n: int = 4, protocol: int = 2) -> list[dict]:
    """Write the official layout: data_batch_1..5 + test_batch, pickled dicts with bytes keys."""
    root.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = []
    for i, name in enumerate(names):
        batch = cifar_batch(n if name != "test_batch" else 3, i)
        (root / name).write_bytes(pickle.dumps(batch, protocol=protocol))
        batches.append(batch)
    return batches


@pytest.fixture
def http_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """A loopback HTTP server on 127.0.0.1 serving a temp directory (never the internet)."""
    root = tmp_path / "served"
    root.mkdir()
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(root)))
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# ----------------------------------------------------------------------------- Fashion-MNIST


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Fashion-MNIST not installed")
def test_real_fashion_mnist() -> None:
    ds = load_dataset("fashion-mnist")
    assert isinstance(ds, pd.ImageDataset)
    assert ds.train_images.shape == (60000, 1, 28, 28) and ds.train_images.dtype == torch.uint8
    assert ds.test_images.shape == (10000, 1, 28, 28)
    assert ds.train_labels.dtype == torch.int64 and ds.train_labels.shape == (60000,)
    assert ds.test_labels.shape == (10000,)
    assert int(ds.train_labels.min()) == 0 and int(ds.train_labels.max()) == 9
    assert torch.bincount(ds.test_labels).tolist() == [1000] * 10
    assert ds.num_classes == 10 and ds.in_channels == 1 and ds.image_size == (28, 28)
    # the normalization constants really are the training-set statistics
    x = ds.train_images[:10000].float() / 255
    assert abs(x.mean().item() - ds.mean[0]) < 0.01 and abs(x.std().item() - ds.std[0]) < 0.01


@pytest.mark.parametrize("gz", [True, False])
def test_idx_roundtrip(tmp_path: Path, gz: bool) -> None:
    written = make_fashion_dir(tmp_path, gz=gz)
    for split in ("train", "test"):
        x, y = load_fashion_mnist(tmp_path, split)
        imgs, labels = written[split]
        assert x.shape == (len(imgs), 1, 28, 28) and x.dtype == torch.uint8
        assert torch.equal(x[:, 0], torch.from_numpy(imgs))
        assert torch.equal(y, torch.from_numpy(labels.astype(np.int64)))


def test_cached_tensors_are_independent_copies(tmp_path: Path) -> None:
    make_fashion_dir(tmp_path)
    x, _ = load_fashion_mnist(tmp_path)
    x.zero_()
    assert load_fashion_mnist(tmp_path)[0].any()


def test_disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_fashion_dir(tmp_path / "fm")
    x, y = load_fashion_mnist(tmp_path / "fm", cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache" / "fashion-mnist-train.pt").is_file()
    pd.clear_cache()

    def boom(*args: object) -> None:
        raise AssertionError("should have been served from the .pt cache")

    monkeypatch.setattr(pd.fashion, "read_idx", boom)
    x2, y2 = load_fashion_mnist(tmp_path / "fm", cache_dir=tmp_path / "cache")
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_hold_out_is_a_fixed_disjoint_validation_split(tmp_path: Path) -> None:
    make_fashion_dir(tmp_path, n_train=200, n_test=30)  # pixel (0, 0) = the file index
    ds = load_dataset("fashion-mnist", tmp_path)
    held = ds.hold_out(50)
    train = held.train_images[:, 0, 0, 0].tolist()
    val = held.val_images[:, 0, 0, 0].tolist()
    assert len(val) == 50 and len(train) == 150
    assert not set(train) & set(val) and sorted(train + val) == list(range(200))
    assert train == sorted(train) and val == sorted(val)  # file order: --train-subset = first N
    assert torch.equal(held.val_labels, ds.train_labels[held.val_images[:, 0, 0, 0].long()])
    # Never the test split's images (pixel (0, 0) of those counts 0..29 too: compare wholly).
    flat_test = {bytes(t.flatten().tolist()) for t in held.test_images}
    assert not any(bytes(v.flatten().tolist()) in flat_test for v in held.val_images)
    assert torch.equal(held.test_images, ds.test_images)
    # The same draw whatever the global RNG (a run's seed) and on every call (every rank).
    torch.manual_seed(12345)
    again = load_dataset("fashion-mnist", tmp_path).hold_out(50)
    assert torch.equal(again.val_images, held.val_images)
    assert torch.equal(again.train_images, held.train_images)
    none = ds.hold_out(0)
    assert torch.equal(none.train_images, ds.train_images) and len(none.val_labels) == 0
    for bad in (200, -1):
        with pytest.raises(DataError) as info:
            ds.hold_out(bad)
        assert str(info.value) == (f"val_subset {bad} is invalid: allowed 0 (none) to 199 (the "
                                   "training images of fashion-mnist, less one to train on)")


def _expect_error(match_path: Path, fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert str(match_path) in msg and "\n" not in msg
    return msg


def test_idx_wrong_magic(tmp_path: Path) -> None:
    make_fashion_dir(tmp_path)
    bad = write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2049, np.zeros((12, 28, 28), np.uint8))
    msg = _expect_error(bad, load_fashion_mnist, tmp_path, "train")
    assert "2051" in msg and "magic" in msg


@pytest.mark.parametrize("gz", [True, False])
def test_idx_truncated(tmp_path: Path, gz: bool) -> None:
    make_fashion_dir(tmp_path, gz=gz)
    name = "t10k-images-idx3-ubyte" + (".gz" if gz else "")
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:-50])
    _expect_error(path, load_fashion_mnist, tmp_path, "test")


def test_idx_truncated_payload(tmp_path: Path) -> None:
    make_fashion_dir(tmp_path)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(2049, np.zeros(5, np.uint8))[:-2]))
    assert "truncated" in _expect_error(path, load_fashion_mnist, tmp_path, "test")


def test_idx_count_mismatch_and_bad_labels(tmp_path: Path) -> None:
    make_fashion_dir(tmp_path)
    lbl = write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, np.zeros(11, np.uint8))
    msg = _expect_error(tmp_path / "train-images-idx3-ubyte.gz", load_fashion_mnist, tmp_path)
    assert "12 images" in msg and "11 labels" in msg
    write_idx(lbl, 2049, np.full(12, 10, np.uint8))
    _expect_error(lbl, load_fashion_mnist, tmp_path)


def test_fashion_missing_dir_and_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope", load_fashion_mnist, tmp_path / "nope")
    make_fashion_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    _expect_error(tmp_path / "t10k-labels-idx1-ubyte.gz", load_fashion_mnist, tmp_path, "test")
    with pytest.raises(DataError, match="split"):
        load_fashion_mnist(tmp_path, "valid")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_batches(tmp_path: Path, protocol: int) -> None:
    root = tmp_path / "cifar-10-batches-py"
    batches = make_cifar_dir(root, n=4, protocol=protocol)
    x, y = load_cifar10(tmp_path, "train")  # the parent directory is accepted too
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert y.tolist() == [v for b in batches[:5] for v in b[b"labels"]]
    # row layout: 1024 red, 1024 green, 1024 blue values, each 32x32 row-major
    row = batches[1][b"data"][2]
    assert torch.equal(x[6, 1, 3, 5], torch.tensor(row[1024 + 3 * 32 + 5]))
    xt, yt = load_cifar10(root, "test")
    assert xt.shape == (3, 3, 32, 32) and yt.tolist() == batches[5][b"labels"]
    ds = load_dataset("CIFAR10", root)
    assert isinstance(ds, pd.ImageDataset) and ds.crop_padding == 4 and ds.in_channels == 3


def test_cifar_rejects_malicious_and_malformed(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    make_cifar_dir(root)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    _expect_error(root / "data_batch_3", load_cifar10, root)
    assert not marker.exists()

    bad = cifar_batch(4, 0)
    bad[b"data"] = bad[b"data"][:, :3000]
    (root / "data_batch_3").write_bytes(pickle.dumps(bad, protocol=2))
    assert "3072" in _expect_error(root / "data_batch_3", load_cifar10, root)

    bad = cifar_batch(4, 0)
    bad[b"labels"] = bad[b"labels"][:3]
    (root / "data_batch_3").write_bytes(pickle.dumps(bad, protocol=2))
    _expect_error(root / "data_batch_3", load_cifar10, root)

    (root / "test_batch").unlink()
    _expect_error(root / "test_batch", load_cifar10, root, "test")
    _expect_error(tmp_path / "missing", load_cifar10, tmp_path / "missing")


# ----------------------------------------------------------------------------- download (loopback)


def test_download_fashion(http_root: tuple[Path, str], tmp_path: Path) -> None:
    served, url = http_root
    written = make_fashion_dir(served)
    sums = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in served.iterdir()}
    dest = tmp_path / "dl"
    out = download("fashion-mnist", dest, base_url=url, checksums=sums)
    assert out == dest and sorted(p.name for p in dest.iterdir()) == sorted(sums)
    x, _ = load_fashion_mnist(out, "test")
    assert torch.equal(x[:, 0], torch.from_numpy(written["test"][0]))

    # a corrupt local file is re-fetched; a checksum mismatch leaves no file behind
    (dest / "t10k-labels-idx1-ubyte.gz").write_bytes(b"junk")
    download("fashion-mnist", dest, base_url=url, checksums=sums)
    assert (
        hashlib.md5((dest / "t10k-labels-idx1-ubyte.gz").read_bytes()).hexdigest()
        == sums["t10k-labels-idx1-ubyte.gz"]
    )
    wrong = dict(sums, **{"train-images-idx3-ubyte.gz": "0" * 32})
    fresh = tmp_path / "dl2"
    with pytest.raises(DataError, match="md5"):
        download("fashion-mnist", fresh, base_url=url, checksums=wrong)
    assert not (fresh / "train-images-idx3-ubyte.gz").exists()
    assert not list(fresh.glob(".*part"))


def test_download_http_error(http_root: tuple[Path, str], tmp_path: Path) -> None:
    _, url = http_root
    with pytest.raises(DataError, match=re.escape(url)):
        download("fashion-mnist", tmp_path / "dl", base_url=url, verify=False)
    with pytest.raises(DataError, match="unknown image dataset"):
        download("mnist", tmp_path / "dl", base_url=url)


def _tar_gz(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_download_cifar_tarball(http_root: tuple[Path, str], tmp_path: Path) -> None:
    served, url = http_root
    src = tmp_path / "src" / "cifar-10-batches-py"
    make_cifar_dir(src)
    with tarfile.open(served / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-py")
    md5 = hashlib.md5((served / "cifar-10-python.tar.gz").read_bytes()).hexdigest()
    out = download(
        "cifar10", tmp_path / "data", base_url=url, checksums={"cifar-10-python.tar.gz": md5}
    )
    assert out == tmp_path / "data" / "cifar-10-batches-py"
    x, _ = load_cifar10(out, "train")
    assert x.shape == (20, 3, 32, 32)
    assert not list((tmp_path / "data").glob(".extract-*"))


def test_download_cifar_rejects_path_traversal(http_root: tuple[Path, str], tmp_path: Path) -> None:
    served, url = http_root
    _tar_gz(served / "cifar-10-python.tar.gz", {"cifar-10-batches-py/../../evil.txt": b"x"})
    dest = tmp_path / "a" / "b"
    with pytest.raises(DataError, match="unsafe"):
        download("cifar10", dest, base_url=url, verify=False)
    assert not (tmp_path / "a" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()


# ----------------------------------------------------------------------------- tensor loader


def index_images(n: int, channels: int = 1, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose every pixel stores the example index (mod 256), labels = index."""
    x = (
        (torch.arange(n) % 256)
        .to(torch.uint8)
        .view(n, 1, 1, 1)
        .expand(n, channels, size, size)
        .contiguous()
    )
    return x, torch.arange(n)


def test_loader_shards_match_distributed_sampler() -> None:
    n = 101
    x, y = index_images(n)
    seen = []
    for rank in range(2):
        loader = TensorImageLoader(
            x, y, 8, mean=[0.0], std=[1 / 255], shuffle=True, seed=3, rank=rank, world_size=2
        )
        loader.set_epoch(4)
        sampler = DistributedSampler(
            range(n), num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True
        )
        sampler.set_epoch(4)
        assert loader.indices().tolist() == list(sampler)
        labels = []
        for xb, yb in loader:
            assert xb.dtype == torch.float32 and xb.shape[1:] == (1, 8, 8)
            assert torch.equal(xb[:, 0, 0, 0].round().long(), yb % 256)  # images stay with labels
            labels += yb.tolist()
        assert len(labels) == loader.num_samples == 50 and len(loader) == 7
        seen.append(set(labels))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 100


def test_loader_epochs_deterministic() -> None:
    x, y = index_images(64)

    def order(epoch: int) -> list[int]:
        loader = TensorImageLoader(x, y, 16, mean=[0.5], std=[0.5], shuffle=True, seed=1)
        loader.set_epoch(epoch)
        return torch.cat([yb for _, yb in loader]).tolist()

    assert order(0) == order(0) and order(1) == order(1)
    assert order(0) != order(1) and sorted(order(1)) == list(range(64))
    plain = TensorImageLoader(x, y, 16, mean=[0.5], std=[0.5])
    assert torch.cat([yb for _, yb in plain]).tolist() == list(range(64))


def test_loader_augment_subset_drop_last() -> None:
    x = torch.randint(0, 256, (30, 3, 12, 12), dtype=torch.uint8)
    y = torch.arange(30)
    loader = TensorImageLoader(
        x,
        y,
        4,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
        shuffle=True,
        augment=True,
        subset=10,
        drop_last=True,
    )
    batches = list(loader)
    assert len(batches) == len(loader) == 2
    for xb, yb in batches:
        assert xb.shape == (4, 3, 12, 12) and xb.dtype == torch.float32 and yb.dtype == torch.int64
        assert int(yb.max()) < 10
    loader.set_epoch(1)
    a = torch.cat([xb for xb, _ in loader])
    assert torch.equal(a, torch.cat([xb for xb, _ in loader]))  # same epoch -> same augmentation
    with pytest.raises(DataError):
        TensorImageLoader(x, y, 4, mean=[0.5], std=[0.5], rank=2, world_size=2)
    with pytest.raises(DataError):
        TensorImageLoader(x.float(), y, 4, mean=[0.5], std=[0.5])


def test_random_crop_flip_is_a_shifted_window() -> None:
    x = torch.arange(2 * 6 * 6, dtype=torch.uint8).view(2, 1, 6, 6).repeat(1, 2, 1, 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        out = random_crop_flip(x, 2, True, g)
        assert out.shape == x.shape and out.dtype == torch.uint8
        padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
        for b in range(2):
            windows = [
                padded[b, :, i : i + 6, j : j + 6].flip(-1)
                if f
                else padded[b, :, i : i + 6, j : j + 6]
                for i in range(5)
                for j in range(5)
                for f in (False, True)
            ]
            assert any(torch.equal(out[b], w) for w in windows)
    assert torch.equal(random_crop_flip(x, 0, False), x)


# ----------------------------------------------------------------------------- text


@pytest.mark.skipif(shutil.which("bible") is None, reason="bible-kjv not installed")
def test_kjv_corpus() -> None:
    corpus = load_dataset("kjv")
    assert isinstance(corpus, Corpus)
    total = corpus.train.numel() + corpus.valid.numel() + corpus.test.numel()
    eos = sum(
        int((t == corpus.vocab.word2idx["<eos>"]).sum())
        for t in (corpus.train, corpus.valid, corpus.test)
    )
    assert eos == 31102
    assert 780_000 < total - eos < 800_000
    ref = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+$")
    assert not [w for w in corpus.vocab.idx2word if ref.match(w)]
    assert corpus.vocab.decode(corpus.train[:4]) == ["In", "the", "beginning", "God"]
    assert 0.04 < corpus.test.numel() / total < 0.06


def test_missing_bible() -> None:
    with pytest.raises(DataError, match="apt-get install bible-kjv"):
        pd.load_kjv("no-such-bible-program")


def test_text_file_corpus(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    lines = [f"line {i} says w{i % 7} hello" for i in range(40)]
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    assert load_text_file(path) == lines
    corpus = load_dataset(str(path))
    assert isinstance(corpus, Corpus)
    assert [corpus.train.numel(), corpus.valid.numel(), corpus.test.numel()] == [
        36 * 6,
        2 * 6,
        2 * 6,
    ]
    assert corpus.vocab.decode(corpus.valid[:6]) == ["line", "36", "says", "w1", "hello", "<eos>"]
    tr, va, te = split_lines(lines, 0.05, 0.05, "contiguous")
    assert (tr[-1], va, te) == (lines[35], lines[36:38], lines[38:])


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_empty_text_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    msg = _expect_error(path, load_dataset, str(path))
    assert "empty" in msg


def test_bad_text_inputs(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    _expect_error(path, load_text_file, path)
    _expect_error(tmp_path / "none.txt", load_text_file, tmp_path / "none.txt")
    with pytest.raises(DataError, match="fashion-mnist, cifar10, kjv"):
        load_dataset("imagenet")


def test_batchify_and_bptt_sharding() -> None:
    ids = torch.arange(103)
    src = batchify(ids, 4)
    assert src.shape == (25, 4) and src[:, 1].tolist() == list(range(25, 50))
    data, target = get_bptt_batch(src, 20, 8)
    assert data.shape == (4, 4) and torch.equal(target, src[21:25])
    with pytest.raises(DataError):
        batchify(torch.arange(5), 4)

    full = BPTTLoader(ids, 4, 7)
    shards = [BPTTLoader(ids, 2, 7, rank=r, world_size=2) for r in range(2)]
    assert len(full) == len(shards[0]) == len(shards[1]) == 4
    for (d, t), (d0, t0), (d1, t1) in zip(full, *shards):
        assert torch.equal(d, torch.cat([d0, d1], 1)) and torch.equal(t, torch.cat([t0, t1], 1))
    assert sum(t.numel() for _, t in full) == full.tokens_per_epoch == 24 * 4
