"""``--logger tensorboard``: a run's metrics also as TensorBoard event files, in ``RUN_DIR/tb``.

The run's record stays ``metrics.jsonl``/``.csv``; their writers (:mod:`.metrics`) forward to a
:class:`Board`: every epoch's row (``epoch/*``), the evaluations of ``--eval-every-steps``
(``eval/*``), per optimizer step rank 0's loss, the LR, the step's time and the bytes it sent
(``step/*``), and each change of the model (the switch: ``factorization/*`` scalars such as
``params_before``/``params_after``, and its report as text). The x axis is the global optimizer
step throughout. Only rank 0 writes. A run (fresh or resumed) opens the writer with
``purge_step`` = its first step, so the steps, evaluations and epochs it is about to redo after a
crash are not shown twice. ``tensorboard`` is an optional package (``pip install tensorboard``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError

__all__ = ["BOARD_SUBDIR", "Board", "open_board", "summary_writer"]

BOARD_SUBDIR = "tb"  # RUN_DIR/tb: the event files
# Steps whose losses are kept as tensors and written together: one device sync per this many
# steps, not one per step.
FLUSH_EVERY = 100


def summary_writer() -> type:
    """torch's ``SummaryWriter``; a one-line ConfigError when ``tensorboard`` is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("logger 'tensorboard' needs the tensorboard package, which is not "
                          "installed: pip install tensorboard (or use logger 'none')") from None
    return SummaryWriter


def open_board(logger: str, run_dir: Path, enabled: bool, first_step: int) -> Board | None:
    """The run's Board (rank 0 with ``logger`` tensorboard), or None; ``first_step``: the global
    step the run's next optimizer step will have (1 for a fresh start)."""
    if logger != "tensorboard" or not enabled:
        return None
    return Board(run_dir / BOARD_SUBDIR, first_step, summary_writer())


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (booleans as 0/1); strings, lists and nested records are not scalars."""
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float)}


class Board:
    """One ``SummaryWriter`` into ``log_dir``; the steps' scalars are buffered (FLUSH_EVERY)."""

    def __init__(self, log_dir: Path, first_step: int, writer_class: type) -> None:
        self.writer = writer_class(log_dir=str(log_dir), purge_step=first_step)
        self.pending: list[tuple[int, torch.Tensor, dict[str, float], float]] = []

    def step(self, step: int, loss: torch.Tensor, figures: dict[str, float]) -> None:
        """Optimizer step ``step`` is done: its loss (a tensor, read later) and other scalars."""
        self.pending.append((step, loss.detach(), figures, time.time()))
        if len(self.pending) >= FLUSH_EVERY:
            self._write_steps()

    def epoch(self, row: dict[str, Any], step: int) -> None:
        self._write_scalars("epoch", _scalars(row), step)

    def evaluation(self, row: dict[str, Any]) -> None:
        self._write_scalars("eval", _scalars({k: v for k, v in row.items() if k != "step"}),
                            row["step"])

    def change(self, name: str, text: str, record: dict[str, Any], step: int) -> None:
        """A change of the model before optimizer step ``step``: its figures and its report."""
        self._write_steps()
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"{name}/{key}", value, step)
        # Markdown: indented four spaces, the report's table keeps its columns.
        self.writer.add_text(name, "\n".join("    " + line for line in text.splitlines()), step)
        self.writer.flush()

    def close(self) -> None:
        self._write_steps()
        self.writer.close()

    def _write_scalars(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        self._write_steps()
        for key, value in scalars.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def _write_steps(self) -> None:
        if not self.pending:
            return
        losses = torch.stack([loss.float() for _, loss, _, _ in self.pending]).cpu().tolist()
        for (step, _, figures, wall), loss in zip(self.pending, losses):
            for key, value in {"loss": loss, **figures}.items():
                self.writer.add_scalar(f"step/{key}", value, step, walltime=wall)
        self.pending.clear()
