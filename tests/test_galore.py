"""--mode galore: GaLore's optimizer (pytorch-optimizer) on the layers Pufferfish would factorize,
in the loop: projected groups, 2-process DDP, checkpoints with the projectors, exact resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import metrics, run_cli, tiny_transformer_args

from pufferfish.config import TrainConfig
from pufferfish.models import build_at_width
from pufferfish.training.checkpoint import latest_checkpoint

pytest.importorskip("pytorch_optimizer")


def test_galore_projects_the_layers_pufferfish_would_factorize() -> None:
    from pufferfish.baselines.galore import GaLoreMethod

    cfg = TrainConfig(model="transformer", data="kjv", mode="galore", lr=1e-3)
    model = build_at_width("transformer", 0.125, vocab_size=50)
    method = GaLoreMethod(cfg)
    method.setup(model, None, cfg)
    # layer 0, the embeddings and the head are the preset's full-rank layers: plain AdamW
    assert "encoder.layers.1.linear1.weight" in method.ranks
    assert method.ranks["encoder.layers.1.self_attn.in_proj_weight"] == 8  # 32 x 0.25
    assert not any(n.startswith("encoder.layers.0.") for n in method.ranks)
    opt = method.build_optimizer(model, cfg)
    projected = [g for g in opt.param_groups if "rank" in g]
    assert {g["update_proj_gap"] for g in projected} == {200}  # the paper's defaults
    assert {g["scale"] for g in projected} == {0.25}
    assert sum(len(g["params"]) for g in projected) == len(method.ranks)
    assert all(p.dim() == 2 for g in projected for p in g["params"])


def test_two_process_galore_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *tiny_transformer_args(
        tmp_path, "--epochs", "1", "--mode", "galore", "--galore-update-proj-gap", "10",
        "--out", str(out)), torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = metrics(out)
    assert row["galore_params"] == 12 and not row["lowrank"]
    # DDP ships every gradient at full size
    assert row["comm_bytes_per_step"] == pytest.approx(4 * row["params"], rel=0.01)
    state, _ = latest_checkpoint(out)  # loads with weights_only=True
    projectors = [s["projector"] for s in state["optimizer"]["state"].values() if "projector" in s]
    assert len(projectors) == 12
    assert all(isinstance(p["ortho_matrix"], torch.Tensor) for p in projectors)
    assert {p["last_svd_step"] for p in projectors} == {30}  # refreshed every 10 of 30 steps


def test_galore_resume_is_exact(tmp_path: Path) -> None:
    args = tiny_transformer_args(tmp_path, "--epochs", "1", "--mode", "galore", "--train-subset",
                                 "1200", "--galore-update-proj-gap", "8",
                                 "--checkpoint-every-steps", "6")
    ref = tmp_path / "ref"
    assert run_cli("train", *args, "--out", str(ref)).returncode == 0
    run, marker = tmp_path / "run", tmp_path / "killed"
    killed = run_cli("train", *args, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": "21", "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    resumed = run_cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = latest_checkpoint(ref)[0]["model"], latest_checkpoint(run)[0]["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert metrics(ref)[0]["test_ppl"] == metrics(run)[0]["test_ppl"]


def test_galore_without_its_package_exits_2() -> None:
    code = ("import sys; sys.modules['pytorch_optimizer'] = None\n"
            "from pufferfish.cli import main\n"
            "sys.exit(main(['train', '--mode', 'galore', '--model', 'transformer', "
            "'--data', 'kjv']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1
    assert "mode 'galore' needs the package pytorch-optimizer" in result.stderr


def test_galore_on_a_model_without_2d_weights_to_project_exits_2() -> None:
    result = run_cli("train", "--mode", "galore", "--model", "resnet18", "--width", "0.125",
                     "--train-subset", "64", "--batch-size", "32", "--epochs", "1",
                     "--no-progress")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--mode 'galore' is invalid with --model 'resnet18'" in result.stderr
