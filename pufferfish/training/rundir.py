"""The run directory as one run's own: claimed exclusively, and its files known by record.

* A fresh default directory (``runs/<model>-<mode>-<date-time>``) is made by
  :func:`pufferfish.outputs.make_fresh` (one atomic ``mkdir``; a name taken in the meantime gets
  the next suffix).
* Rank 0 holds the directory for the run's life (:func:`pufferfish.outputs.hold`'s lock, an
  exclusive ``flock`` on ``RUN_DIR/.pufferfish.lock``, as every command that writes an ``--out``):
  a second writer is refused naming the holder's command and pid; the OS releases it when the
  process dies, so a restart or a resume after a crash takes it again (the file stays then; a run
  that ends removes it).
* Which files ``pufferfish train`` wrote is in the directory's outputs record
  (:mod:`pufferfish.outputs`, command ``train``), not guessed from file names: a directory that
  merely holds a ``config.toml`` of the user's is no earlier run, and ``--overwrite`` removes only
  recorded files. Run directories written before the record existed are recognised by their
  checkpoints' manifests (a JSON file with the checkpoint's SHA-256, written by us).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from ..config import ConfigError
from ..outputs import (
    LOCK,
    RECORD,
    Held,
    OutputsError,
    forget_outputs,
    make_out,
    owners,
    record_outputs,
)
from . import checkpoint as ckpt
from .board import BOARD_SUBDIR

COMMAND = "train"  # the outputs record's name for this command
# What a run may write at its top level, besides the methods' change records (recorded when
# written): the folders stand for the checkpoint files and event files in them.
RUN_NAMES = ("config.toml", "metrics.jsonl", "metrics.csv", "evals.jsonl", "buckets.json",
             ckpt.CHECKPOINT_SUBDIR, BOARD_SUBDIR)
BOOKKEEPING = (LOCK, RECORD)  # ours, never "the user's files", never a run's output

# The files a run writes into its directory besides its checkpoints (build.py: config and the
# bucket choices, metrics.py, and the methods' change records: factorization, prune-round-N,
# channel-pruning), and board.py's event files in tb/ (--logger tensorboard).
_RUN_FILE = r"(config\.toml|buckets\.json|metrics\.(jsonl|csv)|evals\.jsonl|(factorization|channel-pruning|prune-round-\d+)\.(txt|json))"
_RUN_FILE_RE = re.compile(rf"^{_RUN_FILE}$")
# Their temp files, left by a kill during a write (checkpoint.atomic_write's, and the
# ``<name>.tmp`` of runs written before every write went through it).
_RUN_TEMP_RE = re.compile(rf"^({_RUN_FILE}\.tmp|\.{_RUN_FILE}\.[A-Za-z0-9_-]+\.\d+\.[0-9a-f]+\.tmp)$")


class RunLock(Held):
    """Rank 0's exclusive hold on a run directory: :class:`~pufferfish.outputs.Held`, the hold
    every command that writes an ``--out`` takes, for ``train``."""

    def __init__(self, run_dir: Path, created: bool) -> None:
        super().__init__(run_dir, COMMAND, created)
        self.run_dir = run_dir

    def acquire(self) -> RunLock:
        """Take the lock, or refuse in one line naming the command and pid that hold it."""
        try:
            super().acquire()
        except OutputsError as e:  # as the run's other errors: every rank learns it (startup)
            raise ConfigError(str(e)) from None
        return self

    def release(self, refused: bool = False) -> None:  # type: ignore[override]
        """Let go (the lock file removed: a waiting run retries on the new one). Unless the run
        was ``refused`` (which leaves the record as it was), names it recorded but never wrote
        are forgotten; a directory it created and wrote nothing into is removed again."""
        super().release(None if refused else _forget_unwritten)


def _forget_unwritten(run_dir: Path) -> None:
    """The record keeps only names this run (or an earlier one) wrote: one that failed before
    writing leaves the user's directory as it found it."""
    names = _recorded(run_dir)
    if names:
        written = {p.relative_to(run_dir).parts[0] for p in run_files(run_dir, temps=True)}
        forget_outputs(run_dir, COMMAND, sorted(names - written))


def lock_run_dir(run_dir: Path, created: bool = False) -> RunLock:
    """Create ``run_dir`` if needed and hold it for this run (:class:`RunLock`); ``created``:
    the caller made it (removed again if the run leaves nothing in it)."""
    try:
        created = make_out(run_dir) or created
    except OutputsError as e:  # said as the run's other bad input (the "--" added when printed)
        raise ConfigError(str(e).removeprefix("--")) from None
    return RunLock(run_dir, created).acquire()


def record_run(run_dir: Path, names: tuple[str, ...] | list[str] = RUN_NAMES) -> None:
    """Note in the outputs record that this run writes ``names`` (before writing them); a run
    of the days before the record gets its existing files recorded too."""
    existing = [p.relative_to(run_dir).parts[0] for p in run_files(run_dir)]
    record_outputs(run_dir, COMMAND, [*names, *dict.fromkeys(existing)])


def _recorded(run_dir: Path) -> set[str] | None:
    """The names the record gives to ``train``; None for a directory of the days before the
    record whose checkpoints carry our manifests (all our names are then its)."""
    record = owners(run_dir)
    if not record and _has_manifests(run_dir):
        return None
    return {name for name, by in record.items() if by == COMMAND}


def _has_manifests(run_dir: Path) -> bool:
    """Whether a checkpoint in ``run_dir`` has its manifest (our JSON with its SHA-256)."""
    for path in ckpt.checkpoint_files(run_dir):
        if path.suffix == ".json":
            with contextlib.suppress(OSError, ValueError):
                if "sha256" in json.loads(path.read_text()):
                    return True
    return False


def _candidates(run_dir: Path, temps: bool) -> list[Path]:
    """Every file named like one of a run's (``temps``: and their temp files)."""
    if not run_dir.is_dir():
        return []
    top = sorted(p for p in run_dir.iterdir() if p.is_file() and (
        _RUN_FILE_RE.match(p.name) or (temps and _RUN_TEMP_RE.match(p.name))))
    board = sorted(p for p in (run_dir / BOARD_SUBDIR).glob("events.out.tfevents.*")
                   if p.is_file())
    return top + board + ckpt.checkpoint_files(run_dir, temps=temps)


def _is_ours(path: Path, run_dir: Path, names: set[str] | None) -> bool:
    if names is None:
        return True
    first = path.relative_to(run_dir).parts[0]
    if path.parent == run_dir and _RUN_TEMP_RE.match(path.name):
        return bool(names)  # a temp file of an interrupted write of a recorded run
    return first in names


def run_files(run_dir: Path, *, temps: bool = False) -> list[Path]:
    """The files ``pufferfish train`` wrote in ``run_dir`` by its record: checkpoints, metrics,
    config, change records, event files (``temps``: also the temp files of interrupted writes).
    Never other files, nor the checkpoints set aside in ``checkpoints/rejected/``."""
    names = _recorded(run_dir)
    return [p for p in _candidates(run_dir, temps) if _is_ours(p, run_dir, names)]


def foreign_files(run_dir: Path) -> list[Path]:
    """Files named like a run's that the record does not give to ``train``: the user's."""
    names = _recorded(run_dir)
    return [p for p in _candidates(run_dir, False) if not _is_ours(p, run_dir, names)]
