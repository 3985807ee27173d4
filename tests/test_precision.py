"""--amp on CPU: refused in one line where the CPU has no bf16 kernel for the model's LSTM."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from helpers import free_port
from torch import nn

from pufferfish.config import TrainConfig
from pufferfish.training.precision import bf16_refused, recurrent_kinds

# oneDNN capped at AVX2 (an AMD EPYC's kernels, on any x86 CPU): no bf16 LSTM.
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}


def torchrun_train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``pufferfish train ARGS`` on 2 processes under the AVX2 ISA, a tiny LSTM on 2,400 words."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choices([f"w{i}" for i in range(50)], k=12))
                                for _ in range(200)) + "\n")
    port = free_port()
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(port), "-m", "pufferfish", "train", "--model", "lstm", "--width", "0.02", "--data",
         str(corpus), "--batch-size", "4", "--bptt", "10", "--threads", "1", "--no-progress",
         *args], capture_output=True, text=True, timeout=240, env={**os.environ, **AVX2})


def test_only_models_with_recurrent_layers_are_probed() -> None:
    assert recurrent_kinds(TrainConfig(model="lstm", width=0.02)) == [nn.LSTM]
    for model in ("resnet18", "vgg19_bn", "transformer", "llama"):
        assert recurrent_kinds(TrainConfig(model=model, width=0.125)) == [], model


def test_the_probe_leaves_the_random_state_as_it_was() -> None:
    # The probe builds and runs a layer once: a run with --amp must start from the same weights.
    bf16_refused.cache_clear()
    before = torch.get_rng_state()
    reason = bf16_refused(nn.LSTM)
    assert torch.equal(torch.get_rng_state(), before)
    assert reason is None or "LSTM" in reason  # either this CPU runs it, or oneDNN says why


def test_amp_lstm_run_is_refused_in_one_line_without_a_bf16_kernel(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = torchrun_train(tmp_path, "--epochs", "1", "--amp", "--out", str(out))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("pufferfish: error:")]
    # One line per rank that got to print it (torchrun stops the other once one has exited).
    assert errors, result.stderr[-3000:]
    assert all("--amp" in e and "LSTM" in e and "on rank 0" in e and "allowed: --no-amp" in e
               for e in errors)
    assert "RuntimeError" not in result.stderr  # the failure it replaces: oneDNN's, mid-run
    assert not out.exists()  # refused before the run directory was made
