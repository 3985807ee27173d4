"""What a run shows while it trains, on rank 0: one bar over the whole run and one per evaluation.

The run's bar counts every optimizer step of every epoch (``epoch N/M`` in front), so its ETA is
for the run, not the epoch; its rate is the mean since the bar started (``smoothing=0``), so from
the first evaluation on the ETA includes the evaluations' share of the time. Each evaluation
shows its own bar of batches below it (``validation`` / ``test``), gone when done. Messages go
through :func:`pufferfish.distributed.env.say`, which prints above the bars (``tqdm.write``), so a
report (the factorization table) never lands inside a bar's line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

from ..config import TrainConfig
from ..distributed.env import DistEnv

__all__ = ["evaluating", "run_bar"]

T = TypeVar("T")


def run_bar(cfg: TrainConfig, env: DistEnv, done: int, steps: int, epochs: int) -> Any:
    """The bar of the whole run: ``epochs`` x ``steps`` optimizer steps, ``done`` already taken
    (a resumed run starts where it was); the loop sets ``epoch N/M`` as its description."""
    return tqdm(total=epochs * steps, initial=done, unit="step", leave=False, smoothing=0,
                mininterval=1.0, disable=not (env.is_main and cfg.progress))


def evaluating(cfg: TrainConfig, env: DistEnv, batches: Iterable[T], split: str) -> Iterator[T]:
    """``batches`` of an evaluation of ``split``, counted on their own bar (rank 0)."""
    yield from tqdm(batches, desc=f"  {split}", unit="batch", leave=False, mininterval=1.0,
                    disable=not (env.is_main and cfg.progress))
