"""Which command wrote which file of an output directory (``report``, ``compare``, ``bench``).

Nothing the user made is overwritten unasked: before a command writes into ``--out`` it claims
the names it may write. A name that exists there and was not written by the same command (another
command's ``report.md``, the user's own file), or that was changed since that command wrote it (a
``report.md`` the user edited), stops it with one line, unless ``overwrite``. The record is
``.pufferfish-outputs.json`` in the directory: ``{name: {"by": command, "sha256": digest}}``
(the digest once :func:`seal_outputs` has seen the file written; older records: ``{name:
command}``). Running the same command again into its own directory replaces its own unchanged
outputs, as a report refreshes, except the names it claims to ``keep`` (a bench's measurements:
replaced only with ``overwrite``). ``train`` records its run directory's files here too
(:func:`record_outputs`; ``training/rundir.py`` decides by it what an earlier run is), and no
other command writes into a directory so recorded.

While a command writes into a directory it holds it (:func:`hold`, :class:`Held`: an exclusive
``flock`` on ``DIR/.pufferfish.lock``, the holder's pid and command in it), from before its claim
until its outputs are sealed: a second command into the same directory is refused in one line
naming the first, so that two writers never mix their files there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["Held", "OutputsError", "claim_outputs", "forget_outputs", "hold", "make_fresh",
           "make_out", "owners", "record_outputs", "seal_outputs"]

RECORD = ".pufferfish-outputs.json"
LOCK = ".pufferfish.lock"  # held (flock) by the command writing into the directory
TRAIN = "train"  # the command whose directory is a run's: no other command writes into it


class OutputsError(ValueError):
    """An output would replace a file this command did not write; the message is one line."""


def _record(out_dir: Path) -> dict[str, dict[str, str]]:
    """The directory's record as ``{name: {"by": command[, "sha256": digest]}}`` (empty if none)."""
    try:
        record = json.loads((out_dir / RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {str(k): ({"by": str(v["by"]), **({"sha256": str(v["sha256"])} if "sha256" in v
                                            else {})}
                     if isinstance(v, dict) and "by" in v else {"by": str(v)})
            for k, v in record.items()}


def _write_record(out_dir: Path, record: dict[str, dict[str, str]]) -> None:
    tmp = out_dir / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / RECORD)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def owners(out_dir: str | Path) -> dict[str, str]:
    """``{name: command}`` of the directory's record (empty when it has none)."""
    return {name: entry["by"] for name, entry in _record(Path(out_dir)).items()}


def _why_taken(out: Path, name: str, entry: dict[str, str] | None, command: str) -> str | None:
    """Why ``command`` may not replace ``out/name``: who wrote it, or that it changed since."""
    path = out / name
    if not path.exists():
        return None
    if entry is None or entry["by"] != command:
        return f"{name} (written by {entry['by'] if entry else 'unknown'})"
    if "sha256" in entry and path.is_file() and _digest(path) != entry["sha256"]:
        return f"{name} (written by {command}, changed since)"
    return None


def cannot_make(out: Path, e: OSError) -> str:
    """The one line for an ``--out`` the system refuses to create (under a file, read-only)."""
    return (f"--out {str(out)!r} cannot be made ({e.strerror}): allowed a directory this user "
            "can create and write")


def make_out(out: Path) -> bool:
    """Make a command's ``--out`` if missing (True: made here); refused in one line
    (``OutputsError``) if it is a file or the system will not make it."""
    if out.exists() and not out.is_dir():
        raise OutputsError(f"--out {str(out)!r} is a file: allowed a directory")
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputsError(cannot_make(out, e)) from None
    return made


def make_fresh(base: Path) -> Path:
    """Create ``base`` (or ``base-2``, ``base-3``, ... if taken) by one atomic ``mkdir`` each, never
    an exists-check then a create: two commands started in the same second get one each."""
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputsError(cannot_make(base.parent, e)) from None
    for n in range(1, 10_000):
        path = base if n == 1 else Path(f"{base}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise OutputsError(f"no free directory name after {base}-9999: allowed --out")


def claim_outputs(out_dir: str | Path, command: str, names: Iterable[str],
                  overwrite: bool = False, keep: Iterable[str] = (), also: str = "") -> None:
    """Claim ``names`` (files or folders, relative to ``out_dir``) for ``command``.

    Refuses (``OutputsError``) when one exists and the record does not say ``command`` wrote it,
    or it changed since (its digest), or it is one of ``keep`` (an earlier ``command``'s results
    that are not made again cheaply, e.g. measurements; ``also``: another way out the message
    offers), unless ``overwrite``; else creates ``out_dir`` and records the names as
    ``command``'s (their digests once :func:`seal_outputs` sees them written).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputsError(f"--out {str(out)!r} is a file: allowed a directory")
    names = list(names)
    record = _record(out)
    if command != TRAIN and _is_training_run(out, record):
        raise OutputsError(
            f"--out {str(out)!r} is a training run's directory (`pufferfish train` wrote it), "
            f"which `pufferfish {command}` does not write into: allowed another --out, e.g. "
            f"{str(out / command)!r}")
    taken = [why for n in names if (why := _why_taken(out, n, record.get(n), command))]
    if taken and not overwrite:
        raise OutputsError(
            f"{str(out)!r} already holds {', '.join(taken)}, which `pufferfish {command}` would "
            "replace: allowed another --out, or --overwrite")
    kept = [n for n in keep if (out / n).exists() and record.get(n, {}).get("by") == command]
    if kept and not overwrite:
        raise OutputsError(
            f"--out {str(out)!r} holds {', '.join(kept)} of an earlier `pufferfish {command}`, "
            "which this one would replace: allowed another --out, "
            + (f"--overwrite, or {also}" if also else "or --overwrite"))
    make_out(out)
    record.update({n: {"by": command} for n in names})
    _write_record(out, record)


def _is_training_run(out: Path, record: dict[str, dict[str, str]]) -> bool:
    """By the record; a run of the days before it by its config.toml and metrics.jsonl."""
    if any(entry["by"] == TRAIN for entry in record.values()):
        return True
    return (out / "config.toml").is_file() and (out / "metrics.jsonl").is_file()


def record_outputs(out_dir: str | Path, command: str, names: Iterable[str]) -> None:
    """Record ``names`` of ``out_dir`` as ``command``'s, unchecked (the caller has checked):
    ``pufferfish train`` notes what it is about to write into its run directory."""
    out = Path(out_dir)
    record = _record(out)
    new = {n: {"by": command} for n in names if record.get(n, {}).get("by") != command}
    if new:
        record.update(new)
        _write_record(out, record)


def forget_outputs(out_dir: str | Path, command: str, names: Iterable[str]) -> None:
    """Drop ``command``'s ``names`` from the record (never written after all); a record left
    empty is removed."""
    out = Path(out_dir)
    record = _record(out)
    gone = [n for n in names if record.get(n, {}).get("by") == command]
    if not gone:
        return
    for name in gone:
        del record[name]
    if record:
        _write_record(out, record)
    else:
        (out / RECORD).unlink(missing_ok=True)


def seal_outputs(out_dir: str | Path, command: str, names: Iterable[str]) -> None:
    """Record the digests of ``command``'s files ``names`` just written in ``out_dir``: a later
    change to one (the user's edit) makes the next claim refuse to replace it."""
    out = Path(out_dir)
    record = _record(out)
    for name in names:
        if (out / name).is_file():
            record[name] = {"by": command, "sha256": _digest(out / name)}
    _write_record(out, record)


# -- a command's hold on its output directory ------------------------------------------------------


class Held:
    """``command``'s exclusive hold on ``out_dir`` (released by :meth:`release`, or by the OS when
    the process dies: the lock file then stays, and the next holder takes it)."""

    def __init__(self, out_dir: str | Path, command: str, created: bool = False) -> None:
        self.out_dir, self.command, self.created = Path(out_dir), command, created
        self.fd: int | None = None

    def acquire(self) -> Held:
        """Take the lock, or refuse (``OutputsError``, one line) naming who holds it."""
        path = self.out_dir / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 128).decode(errors="replace")
                os.close(fd)
                raise OutputsError(self._in_use(holder)) from None
            # Locked a file that a releasing holder had just removed: take the one there now.
            if _same_file(fd, path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.command}\n".encode())
        self.fd = fd
        return self

    def _in_use(self, holder: str) -> str:
        """The refusal: the holder's pid and command as its lock file says (``pid command``; a
        holder of the days before the command was written there: ``pid``)."""
        pid, _, command = holder.strip().partition(" ")
        who = (f"another `pufferfish {command}`" if command == self.command else
               f"`pufferfish {command}`" if command else "another pufferfish command")
        return (f"--out {self.out_dir} is in use by {who} (pid {pid or 'unknown'}); nothing was "
                "changed: allowed another --out, or wait until it ends")

    def release(self, tidy: Callable[[Path], None] | None = None) -> None:
        """Let go: ``tidy(out_dir)`` first (while still held), then the lock file removed (a
        command waiting on it retries on a new one), and the directory if this hold ``created``
        it and it is left empty."""
        if self.fd is None:
            return
        if tidy is not None:
            with contextlib.suppress(OSError):
                tidy(self.out_dir)
        with contextlib.suppress(OSError):
            (self.out_dir / LOCK).unlink()
            if self.created and not any(self.out_dir.iterdir()):
                self.out_dir.rmdir()
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def hold(out_dir: str | Path, command: str, created: bool = False) -> Iterator[Held]:
    """Hold ``out_dir`` for ``command`` while the block writes there (made if missing; refused in
    one line, ``OutputsError``, while another command holds it). On every way out: the names the
    command claimed but never wrote are forgotten, and a directory made for it (here, or by the
    caller: ``created``) and left empty is removed."""
    out = Path(out_dir)
    created = make_out(out) or created
    try:
        held = Held(out, command, created).acquire()
    except OutputsError:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    try:
        yield held
    finally:
        held.release(lambda d: _forget_unwritten(d, command))


def _forget_unwritten(out: Path, command: str) -> None:
    """Drop from the record ``command``'s names that are not there (claimed, never written)."""
    forget_outputs(out, command, [n for n, by in owners(out).items()
                                  if by == command and not (out / n).exists()])
