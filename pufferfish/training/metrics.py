"""Per-epoch metrics of a run: ``metrics.jsonl`` (the record) and ``metrics.csv`` (for tools).

Only rank 0 writes. Each file is rewritten whole through a temporary file and a rename, so a
crash never leaves half a row, and a resumed run drops the rows of epochs it is about to redo.
With ``--logger tensorboard`` the writers also forward what they record, and each optimizer step's
scalars, to the run's :class:`~pufferfish.training.board.Board` (the one place that logs them).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import torch

from ..formatting import markdown_table
from .board import Board
from .checkpoint import atomic_write_text

__all__ = ["EvalLog", "MetricsWriter", "quality_key", "read_metrics", "selection_key"]


def quality_key(row: dict[str, Any]) -> str:
    """The row's headline figure, the one reported: ``test_ppl`` / ``val_ppl`` (language models)
    or ``test_acc``. Not for choosing: see :func:`selection_key`."""
    return next((k for k in ("test_ppl", "val_ppl") if k in row), "test_acc")


def selection_key(row: dict[str, Any]) -> str:
    """The figure choices (an epoch, a switch point, a learning rate, a variant) are made on: the
    validation split's ``val_acc`` / ``val_ppl``; a run without one (``--val-subset 0``, runs
    written before it existed) has only :func:`quality_key`'s."""
    return next((k for k in ("val_acc", "val_ppl") if k in row), quality_key(row))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """The run's record: epoch rows (``write``), and through ``evals`` the evaluations within
    epochs; with a ``board`` (``--logger tensorboard``) also the steps and the model's changes."""

    def __init__(self, run_dir: Path, enabled: bool = True, board: Board | None = None) -> None:
        self.run_dir, self.enabled, self.board = Path(run_dir), enabled, board
        self.rows: list[dict[str, Any]] = []
        self.evals = EvalLog(run_dir, enabled, board)

    def truncate(self, epochs_done: int) -> None:
        """On resume: keep the rows of the first ``epochs_done`` epochs."""
        self.rows = [r for r in read_metrics(self.run_dir) if r["epoch"] <= epochs_done]
        self._flush()

    def write(self, row: dict[str, Any], step: int | None = None) -> None:
        """An epoch's row; ``step``: the global optimizer step it ends at (the board's x axis)."""
        self.rows.append(row)
        self._flush()
        if self.board is not None and step is not None:
            self.board.epoch(row, step)

    def step(self, step: int, loss: torch.Tensor, lr: float, step_time: float,
             comm_bytes: float) -> None:
        """Optimizer step ``step`` (1-based, global) is done: only the board keeps steps."""
        if self.board is not None:
            self.board.step(step, loss, {"lr": lr, "time_s": step_time, "comm_bytes": comm_bytes})

    def change(self, name: str, text: str, record: dict[str, Any], step: int) -> None:
        """The method changed the model before optimizer step ``step`` (the switch); its report
        is already in ``RUN_DIR/<name>.txt/.json``."""
        if self.board is not None:
            self.board.change(name, text, record, step)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def _flush(self) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "metrics.jsonl",
                          "".join(json.dumps(r, default=float) + "\n" for r in self.rows))
        columns = [k for k in dict.fromkeys(k for r in self.rows for k in r)
                   if not isinstance(self.rows[0].get(k), dict)] if self.rows else []
        buf = io.StringIO()
        w = csv.DictWriter(buf, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(self.rows)
        atomic_write_text(self.run_dir / "metrics.csv", buf.getvalue())

    def final_table(self) -> str:
        """A Markdown table of every epoch, printed at the end of a run."""
        if not self.rows:
            return ""
        quality = quality_key(self.rows[-1])
        chosen = selection_key(self.rows[-1])
        cols = ["epoch", "train_loss", *dict.fromkeys((chosen, quality)), "params", "macs", "lowrank", "epoch_time",
                "comm_bytes_per_step"]
        return "\n".join(markdown_table(cols, ([_fmt(c, r.get(c)) for c in cols]
                                               for r in self.rows)))


def _fmt(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in ("val_acc", "test_acc"):
        return f"{100 * value:.2f}%"
    if column in ("params", "macs"):
        return f"{value / 1e6:.2f}M"
    if column == "comm_bytes_per_step":
        return f"{value / 1e6:.2f} MB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class EvalLog:
    """Evaluations within epochs (``--eval-every-steps``): ``evals.jsonl``, one row each, with
    its global ``step``; rewritten whole like the metrics, and cut back on resume."""

    def __init__(self, run_dir: Path, enabled: bool = True, board: Board | None = None) -> None:
        self.path, self.enabled, self.board = Path(run_dir) / "evals.jsonl", enabled, board
        self.rows: list[dict[str, Any]] = []

    def truncate(self, global_step: int) -> None:
        """On resume: keep the evaluations of the first ``global_step`` steps."""
        if self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            self.rows = [r for r in rows if r["step"] <= global_step]
        if self.rows:
            self._flush()

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._flush()
        if self.board is not None:
            self.board.evaluation(row)

    def _flush(self) -> None:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, "".join(json.dumps(r, default=float) + "\n"
                                                 for r in self.rows))
