"""Fetching the image datasets: checksummed downloads and a tarball extraction that refuses escapes.

Nothing is half-written: a download lands in a temp file renamed into place once its length and
md5 check out, and an archive is extracted into a temp directory moved into place at the end.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from ..formatting import one_line
from .cifar import CIFAR10_ARCHIVE, CIFAR10_DIRNAME, CIFAR10_MD5, CIFAR10_URL, CIFAR_FILES
from .errors import DataError
from .fashion import FASHION_FILES, FASHION_MNIST_MD5, FASHION_MNIST_URL
from .validate import canonical_image_name

Md5For = Callable[[str], str | None]


def download(
    name: str,
    data_dir: str | os.PathLike[str],
    base_url: str | None = None,
    *,
    checksums: Mapping[str, str] | None = None,
    verify: bool = True,
    force: bool = False,
    timeout: float = 60.0,
) -> Path:
    """Fetch a dataset into ``data_dir`` and return the directory the loader should be given.

    ``base_url`` is the directory URL the official file names are appended to (default: the
    official servers). ``checksums`` maps file name -> md5 (default: official values); files
    absent from the mapping, or all files with ``verify=False``, are not checked. Existing
    files that pass verification are not re-downloaded unless ``force``.
    """
    key = canonical_image_name(name)
    directory = _make_dir(data_dir)
    default_url = FASHION_MNIST_URL if key == "fashion-mnist" else CIFAR10_URL
    url = (base_url or default_url).rstrip("/") + "/"
    sums = dict((FASHION_MNIST_MD5 | CIFAR10_MD5) if checksums is None else checksums)

    def md5_for(fname: str) -> str | None:
        return sums.get(fname) if verify else None

    fetch_all = _download_fashion if key == "fashion-mnist" else _download_cifar
    return fetch_all(url, directory, md5_for, force, timeout)


def _make_dir(data_dir: str | os.PathLike[str]) -> Path:
    directory = Path(data_dir).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"{directory}: cannot create download directory ({one_line(e, with_type=True)}); expected a writable path"
        ) from e
    return directory


def _download_fashion(
    url: str, directory: Path, md5_for: Md5For, force: bool, timeout: float
) -> Path:
    """The four gzipped IDX files, side by side in ``directory``."""
    for stems in FASHION_FILES.values():
        for stem in stems:
            fname = f"{stem}.gz"
            _fetch(url + fname, directory / fname, md5_for(fname), force, timeout)
    return directory


def _download_cifar(
    url: str, directory: Path, md5_for: Md5For, force: bool, timeout: float
) -> Path:
    """The python tarball, extracted to ``directory/cifar-10-batches-py`` unless already there."""
    target = directory / CIFAR10_DIRNAME
    if not force and all((target / f).is_file() for files in CIFAR_FILES.values() for f in files):
        return target
    archive = _fetch(
        url + CIFAR10_ARCHIVE, directory / CIFAR10_ARCHIVE, md5_for(CIFAR10_ARCHIVE), force, timeout
    )
    return _safe_extract(archive, directory, CIFAR10_DIRNAME)


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fetch(url: str, dest: Path, md5: str | None, force: bool, timeout: float) -> Path:
    """Download ``url`` to ``dest`` via a temp file + atomic rename (no half-written files)."""
    if dest.is_file() and not force and (md5 is None or _md5(dest) == md5):
        return dest
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        digest = _stream(url, fd, timeout)
        if md5 is not None and digest != md5:
            raise DataError(f"{url}: md5 {digest} does not match; expected {md5}")
        os.replace(tmp, dest)
    except DataError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(
            f"{url}: download failed ({one_line(e, with_type=True)}); expected a reachable URL"
        ) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _stream(url: str, fd: int, timeout: float) -> str:
    """Copy ``url`` into the open file ``fd``, check its Content-Length; return its md5."""
    h = hashlib.md5(usedforsecurity=False)
    received = 0
    with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
        length = resp.headers.get("Content-Length")
        while chunk := resp.read(1 << 20):
            out.write(chunk)
            h.update(chunk)
            received += len(chunk)
    if length is not None and length.isdigit() and received != int(length):
        raise DataError(f"{url}: download truncated at {received} bytes; expected {length} bytes")
    return h.hexdigest()


def _safe_extract(archive: Path, data_dir: Path, root: str) -> Path:
    """Extract ``root/`` from a tarball, refusing links, devices and paths escaping ``root``."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            _check_members(archive, members, root)
            _extract_root(tar, members, archive, data_dir, root)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(
            f"{archive}: cannot extract ({one_line(e, with_type=True)}); expected a valid .tar.gz"
        ) from e
    return data_dir / root


def _check_members(archive: Path, members: list[tarfile.TarInfo], root: str) -> None:
    for m in members:
        parts = PurePosixPath(m.name).parts
        if (
            m.name.startswith(("/", "\\"))
            or ".." in parts
            or not parts
            or parts[0] != root
            or not (m.isfile() or m.isdir())
        ):
            raise DataError(
                f"{archive}: unsafe or unexpected archive member {m.name!r}; "
                f"expected only regular files under {root}/"
            )


def _extract_root(
    tar: tarfile.TarFile, members: list[tarfile.TarInfo], archive: Path, data_dir: Path, root: str
) -> None:
    """Extract into a temp directory, then move ``root/`` over ``data_dir/root``."""
    tmpdir = tempfile.mkdtemp(dir=data_dir, prefix=".extract-")
    try:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmpdir, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4; members were validated above
            tar.extractall(tmpdir, members=members)
        src = Path(tmpdir) / root
        if not src.is_dir():
            raise DataError(
                f"{archive}: archive has no {root}/ directory; expected the CIFAR-10 python tarball"
            )
        dest = data_dir / root
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(src, dest)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
