"""``pufferfish bench`` says how far it is: a progress bar over the worker groups while it measures
(:func:`measuring`), and for ``--train`` (and ``make demo``) which run is training and how far.

The training processes write one ``metrics.jsonl`` row per finished epoch (atomically, rank 0);
while they run, a thread of the bench reads that file and prints a line for each new epoch:
``training pufferfish over 100mbit: epoch 2/4, test accuracy 89.10%, 3 min 40 s so far, about
3 min 40 s left``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

__all__ = ["TrainingProgress", "duration", "measuring"]


def measuring(groups: int, file: IO[str] | None = None) -> tqdm:
    """A tqdm bar over the ``groups`` worker groups of a bench's rounds (one per round and link),
    on stderr when it is a terminal (``file``: always there); close it, or use it in a ``with``."""
    return tqdm(total=groups, desc="measuring", unit="group", file=file, leave=False,
                disable=None if file is None else False, dynamic_ncols=True)


def duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 40 s"``, ``"1 h 05 min"``."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class TrainingProgress:
    """Context manager: while it is open, one line per epoch that the run in ``run_dir`` ends.

    ``name`` says which run (method and link), ``epochs`` how many it will train. The time left
    is the mean wall-clock per epoch so far (training and evaluation) times the epochs to go.
    """

    def __init__(self, run_dir: Path, name: str, epochs: int, log: Callable[[str], None],
                 every: float = 2.0) -> None:
        self.path, self.name, self.epochs, self.log, self.every = (
            Path(run_dir) / "metrics.jsonl", name, epochs, log, every)
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> TrainingProgress:
        self.start, self.started_at = time.monotonic(), time.time()
        self.log(f"training {self.name}: {self.epochs} epoch{'s' * (self.epochs != 1)}")
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()
        self.poll()  # the last epoch, if it ended between two looks

    def poll(self) -> None:
        """Print a line for each epoch finished since the last look."""
        rows = self._rows()
        for row in rows[self.seen:]:
            self.log(self.line(row, time.monotonic() - self.start))
        self.seen = max(self.seen, len(rows))

    def line(self, row: dict[str, Any], elapsed: float) -> str:
        epoch = int(row.get("epoch", self.seen + 1))
        quality = (f"test accuracy {100 * row['test_acc']:.2f}%" if "test_acc" in row
                   else f"test perplexity {row.get('test_ppl', float('nan')):.2f}")
        left = elapsed / max(1, epoch) * max(0, self.epochs - epoch)
        tail = f", about {duration(left)} left" if epoch < self.epochs else ", done"
        return (f"training {self.name}: epoch {epoch}/{self.epochs}, {quality}, "
                f"{duration(elapsed)} so far{tail}")

    def _rows(self) -> list[dict[str, Any]]:
        """This run's rows: an earlier run's file (until the run replaces it) is not read."""
        with contextlib.suppress(OSError, ValueError):
            if self.path.stat().st_mtime >= self.started_at - 1:
                return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
        return []
