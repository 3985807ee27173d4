"""The one atomic write of the package: temp file, fsync, rename, directory fsync.

Checkpoints and every small file of a run directory (metrics, config, records) go through
:func:`atomic_write`, so that a kill or power loss leaves the old file or the new one, never a
mixture, under the final name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from .files import temp_path


def fsync_dir(directory: Path) -> None:
    """Persist directory entries (renames/unlinks); without it a rename can be lost."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms that cannot open directories
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(final: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``final`` via temp file + fsync + rename + directory fsync.

    On any failure the temp file is removed and the exception propagates; ``final`` is
    either its old content or the complete new content, never a mixture.
    """
    tmp = temp_path(final)
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(final.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write` of a small text file (metrics, config, records of the run)."""
    atomic_write(path, lambda f: f.write(text.encode()))


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the duration of a file write, then deliver them.

    The writes are atomic anyway (temp file + rename), so an interrupt could never leave half a
    file; deferring it means Ctrl-C or torchrun's SIGTERM also does not throw away a checkpoint
    that was a moment from complete. Only the main thread can install handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(received):
            signal.raise_signal(s)
