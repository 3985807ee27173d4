"""--amp on CPU: refused in one line where the CPU has no bf16 kernel for the model's LSTM."""

from __future__ import annotations

from pathlib import Path

import torch
from test_training import run_cli, tiny_lm_args
from torch import nn

from pufferfish.config import TrainConfig
from pufferfish.training.precision import bf16_refused, recurrent_kinds

# oneDNN capped at AVX2 (an AMD EPYC's kernels, on any x86 CPU): no bf16 LSTM.
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


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
    result = run_cli("train", *tiny_lm_args(tmp_path, "--epochs", "1", "--amp"), "--out",
                     str(out), env=AVX2, torchrun=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("pufferfish: error:")]
    # One line per rank that got to print it (torchrun stops the other once one has exited).
    assert errors, result.stderr[-3000:]
    assert all("--amp" in e and "LSTM" in e and "on rank 0" in e and "allowed: --no-amp" in e
               for e in errors)
    assert "RuntimeError" not in result.stderr  # the failure it replaces: oneDNN's, mid-run
    assert not out.exists()  # refused before the run directory was made
