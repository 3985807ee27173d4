"""The automatic recipe wired through the Recipe API and the CLI (warm-up, ranks, full-rank layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, metrics, needs_fashion, run_cli, set_diag, tiny_lm_args
from torch import nn

import pufferfish as pf
from pufferfish.config import TrainConfig
from pufferfish.lowrank import LowRankLinear
from pufferfish.switch import SwitchSchedule


def _toy() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def test_recipe_auto_switches_on_a_plateau_and_picks_ranks() -> None:
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: stable ranks never move
    recipe = pf.Recipe(warmup_epochs="auto", rank_ratio="auto")
    switched = None
    for epoch in range(8):
        model, opt, _ = recipe.on_epoch_start(epoch, model, opt)
        if recipe.switched and switched is None:
            switched = epoch
    # Flat from the start: settled as soon as observations reach one window (1 epoch) back, which
    # is also the default minimum warm-up.
    assert switched == 1 and recipe.detector.reason == "settled"
    ranks = recipe.decisions["ranks"]
    # Nothing moved, so Cuttlefish's rule keeps full rank -> capped by the default size budget,
    # the paper's 1/4 preset (16 of 64).
    assert ranks["0"] == 16 and isinstance(model[0], LowRankLinear)
    assert recipe.report is not None and recipe.report.params_after < recipe.report.params_before


def test_recipe_auto_at_the_cap_reads_no_rank_from_a_stable_rank_still_falling() -> None:
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only the writes below move the weights
    # Stable ranks (diagonals of ones) per epoch: layer 0 keeps falling, layer 2 fell, then held.
    diagonals = {0: [32, 16, 4], 2: [32, 4, 4]}
    recipe = pf.Recipe(warmup_epochs="auto", rank_ratio="auto", max_warmup=2)
    for epoch in range(3):
        for i, counts in diagonals.items():
            set_diag(model[i], [1.0] * counts[epoch])
        model, opt, _ = recipe.on_epoch_start(epoch, model, opt)
    assert recipe.switched and recipe.detector.reason == "cap"
    ranks = recipe.decisions["ranks"]
    assert ranks["2"] == 8  # settled: the rule's round(4 * 64 / 32)
    assert ranks["0"] == 16  # still falling 75%/epoch: the budget's rank (the rule would say 8)
    assert recipe.decisions["unsettled"] == ["0"]
    assert "budget (unsettled)" in recipe.describe_decisions()


def test_recipe_auto_without_budget_stops_where_factorizing_stops_saving() -> None:
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio="auto", max_rank_ratio=None)
    for epoch in range(2):
        model, opt, _ = recipe.on_epoch_start(epoch, model, opt)
    assert recipe.decisions["ranks"]["0"] == 31  # 31*(64+64) < 64*64: the last saving rank


def test_recipe_auto_needs_initial_stable_ranks() -> None:
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio="auto")
    with pytest.raises(ValueError, match="stable ranks at initialization"):
        recipe.switch(1, _toy(), None)


@needs_fashion
def test_cli_fully_automatic_run(tmp_path: Path) -> None:
    out = tmp_path / "auto"
    result = run_cli("train", *TINY, "--epochs", "3", "--warmup-epochs", "auto", "--rank-ratio",
                     "auto", "--keep", "auto", "--frobenius-decay", "1e-4",
                     "--max-warmup-epochs", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert "stable_ranks" in rows[0] and len(rows[0]["stable_ranks"]) > 0
    epoch = rows[-1]["switch_epoch"]
    assert epoch in (1, 2)  # at the latest: --max-warmup-epochs
    assert "stable_ranks" not in rows[-1]  # tracking stops at the switch
    record = json.loads((out / "factorization.json").read_text())
    switch = record["decisions"]["switch"]
    if switch["reason"] == "cap":
        assert epoch == 2 == switch["fired_at"]
    else:  # settled between observations: the switch waits for the next epoch boundary
        assert switch["reason"] == "settled" and epoch - 1 < switch["fired_at"] <= epoch
        assert max(switch["change_per_epoch"].values()) < switch["threshold"]
    # observed at the start, then several times per epoch (4 by default)
    history = record["decisions"]["stable_ranks"]["history"]
    times = [t for t, _ in next(iter(history.values()))]
    assert times[0] == 0 and len([t for t in times if 0 < t <= 1]) == 4
    assert record["decisions"]["ranks"]
    measured = record["decisions"]["keep_auto"]["measurements"]
    assert all({"dense_ms", "lowrank_ms", "decision"} <= set(m) for m in measured.values())
    text = (out / "factorization.txt").read_text()  # the decisions are in the readable report too
    assert f"switch epoch (auto): {epoch}" in text and "stable rank at init" in text
    assert "speed-up" in text and "low-rank ms" in text
    # The automatic run records when it switched and what it kept, and reports can plot it.
    report = run_cli("report", str(out), "--out", str(tmp_path / "rep"))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "rep" / "stable_ranks.png").exists()


def test_two_process_automatic_lm_run_agrees_on_every_decision(tmp_path: Path) -> None:
    """Timings differ per process: ranks, kept layers and the LSTM kernel are rank 0's on both
    (a disagreement on ranks would stop DDP; on the kernel, silently cost speed)."""
    out = tmp_path / "run"
    result = run_cli("train", *tiny_lm_args(tmp_path, "--epochs", "3", "--warmup-epochs", "auto",
                                            "--rank-ratio", "auto", "--keep", "auto"),
                     "--out", str(out), torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "factorization.json").read_text())
    kernel = record["decisions"]["kernels"]["rnn"]["kernel"]
    assert kernel in ("fused", "loop")
    assert f"-> {kernel}" in (out / "factorization.txt").read_text()
    rows = metrics(out)
    assert rows[-1]["lowrank"] and rows[-1]["switch_epoch"] in (1, 2)


@pytest.mark.parametrize(("epochs", "steps", "cap"), [
    (8, 39, 4),  # the short-run grid: 150 steps is epoch 4, half the run
    (6, 469, 1), (20, 469, 2), (10, 469, 1),  # all of Fashion-MNIST at batch 2x64: a tenth
    (5, 114, 2),  # the LSTM grid
    (90, 5000, 9), (3, 8, 1)])
def test_default_auto_switch_cap(epochs: int, steps: int, cap: int) -> None:
    when = SwitchSchedule.from_config(TrainConfig(epochs=epochs, warmup_epochs="auto"))
    assert when.auto_cap(steps) == cap
    assert when.auto_cap(steps) <= when.latest_auto_epoch
    fixed = TrainConfig(epochs=epochs, warmup_epochs="auto", max_warmup_epochs=1)
    assert SwitchSchedule.from_config(fixed).auto_cap(steps) == 1


def test_run_switches_at_the_default_cap_and_keeps_it_on_resume(tmp_path: Path) -> None:
    """60 steps per epoch, 8 epochs, ranks that never count as settled (threshold 0): the cap is
    epoch 3 (150 steps), not half the run (4); a run resumed before it keeps that cap."""
    args = tiny_lm_args(tmp_path, "--epochs", "8", "--warmup-epochs", "auto",
                        "--switch-threshold", "0")
    out = tmp_path / "run"
    result = run_cli("train", *args, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    switch = json.loads((out / "factorization.json").read_text())["decisions"]["switch"]
    assert switch["max_epochs"] == 3 and switch["reason"] == "cap"
    assert [r["switch_epoch"] for r in metrics(out)][2:4] == [None, 3]
    # Killed in epoch 2 (after its checkpoint at the end of epoch 1), resumed: the cap comes
    # from the checkpoint (the run's first steps, where it is set, are not run again).
    part = tmp_path / "part"
    killed = run_cli("train", *args, "--out", str(part), env={
        "PUFFERFISH_KILL_AT_STEP": "130", "PUFFERFISH_KILL_MARKER": str(tmp_path / "killed")})
    assert killed.returncode == -9
    resumed = run_cli("train", "--resume", str(part), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert [r["switch_epoch"] for r in metrics(part)][2:4] == [None, 3]
