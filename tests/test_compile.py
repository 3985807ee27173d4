"""--compile: the training loop's model under torch.compile, through the switch.

One process and dynamo's ``eager`` backend (tracing and guards as with inductor, without code
generation, which takes minutes on these CPUs): what is tested is when dynamo compiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils as dynamo_utils
from helpers import tiny_corpus

from pufferfish.config import TrainConfig
from pufferfish.method import PufferfishMethod
from pufferfish.training.loop import train


class _CountingMethod(PufferfishMethod):
    """Pufferfish, recording how many graphs dynamo compiled during each training step."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.compiled: list[int] = []
        self._before = 0

    def on_step_start(self, epoch: int, step: int, steps: int, model: Any) -> Any:
        change = super().on_step_start(epoch, step, steps, model)
        self._before = _graphs()
        return change

    def on_step_end(self, epoch: int, step: int, steps: int, model: Any) -> None:
        self.compiled.append(_graphs() - self._before)
        super().on_step_end(epoch, step, steps, model)


def _graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


def test_compiled_model_recompiles_once_after_the_switch(tmp_path: Path) -> None:
    torch._dynamo.reset()
    # 604 tokens: 4 columns of 151, 15 steps of 10 tokens (no shorter last chunk to recompile)
    cfg = TrainConfig(model="transformer", width=0.125, data=str(tiny_corpus(tmp_path)),
                      train_subset=604, batch_size=4, bptt=10, optimizer="adamw", lr=0.003,
                      epochs=2, warmup_steps=20, compile=True, compile_backend="eager",
                      threads=1, progress=False, out=str(tmp_path / "run"))
    method = _CountingMethod(cfg)
    rows = train(cfg, method)
    assert [r["lowrank"] for r in rows] == [False, True]
    assert len(method.compiled) == 30
    # a graph at the first step, one at the first step after the switch (global step 20), none
    # at any other step (evaluation's own graphs are compiled between epochs)
    assert {i: n for i, n in enumerate(method.compiled) if n} == {0: 1, 20: 1}
