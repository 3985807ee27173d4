"""The checkpoint store's errors and warning, and the one-line account of a failed write."""

from __future__ import annotations

import errno

from ...formatting import one_line


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified, loaded, or does not match this run."""


class UnsafeCheckpointError(CheckpointError):
    """The file passed its checksum but is not a plain-weights checkpoint.

    Distinct from :class:`CheckpointError` because it does not look like a crash
    artifact: :func:`latest_checkpoint` raises it instead of silently falling back.
    """


class CheckpointWarning(UserWarning):
    """An incomplete or corrupt checkpoint was skipped in favour of an older one."""


def describe_failure(exc: BaseException) -> str:
    """Name the root OSError (torch wraps ENOSPC from file objects in a RuntimeError)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            name = errno.errorcode.get(cur.errno, str(cur.errno))
            return f"{name}: {cur.strerror or cur}"
        cur = cur.__cause__ or cur.__context__
    return f"{type(exc).__name__}: {one_line(str(exc), limit=200)}"
