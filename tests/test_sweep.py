"""benchmarks/sweep.py, the study drivers' one run queue, and the studies built on it: a run is
finished by its test metric, resumed from its checkpoint, and phase choices follow validation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pufferfish.training.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import image_ranks  # noqa: E402
import lm_budget  # noqa: E402
import sweep  # noqa: E402


def _finish(path: Path, **row: float) -> None:
    path.mkdir(parents=True)
    row = {"params": 1000, "epoch_time": 1.0, **row}
    (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_a_run_is_finished_by_its_test_metric_and_resumed_from_its_checkpoint(
        tmp_path: Path) -> None:
    run = sweep.Run(tmp_path / "a", ("--mode", "full"))
    assert sweep.command(run)[-4:] == ["--mode", "full", "--out", str(run.path)]  # fresh
    run.path.mkdir()
    (run.path / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "val_acc": 0.5}) + "\n")
    assert sweep.finished(run.path) is None  # no test metric: stopped, not finished
    assert sweep.command(run)[-1] == "--overwrite"  # stopped before its first checkpoint
    save_checkpoint(run.path, {"w": torch.zeros(2)}, 100)
    assert sweep.command(run)[-2:] == ["--resume", "auto"]
    _finish(tmp_path / "b", test_acc=0.9)
    _finish(tmp_path / "c", test_ppl=20.0)
    assert sweep.finished(tmp_path / "b")["test_acc"] == 0.9
    assert [r.path for r in sweep.run_all([sweep.Run(tmp_path / n) for n in "bcd"],
                                          dry_run=True)] == [tmp_path / "d"]


def test_image_study_queues_the_composition_at_powersgd_s_best_rank(tmp_path: Path) -> None:
    names = [r.path.name for r in image_ranks.runs(tmp_path)]
    assert names[:len(image_ranks.METHODS)] == [f"{m}-s0" for m in image_ranks.METHODS]
    assert not any(n.startswith("puff-psgd") for n in names)  # PowerSGD's grid has not run
    vals = {"ddp": 0.92, "psgd-r1": 0.90, "psgd-r2": 0.918, "psgd-r4": 0.921, "psgd-r8": 0.93}
    for method, val in vals.items():
        for seed in image_ranks.SEEDS:
            _finish(image_ranks.run_dir(tmp_path, method, seed), val_acc=val, test_acc=val)
    assert image_ranks.best_psgd_rank(tmp_path) == 2  # the lowest within 0.5 points of DDP
    comp = [r for r in image_ranks.runs(tmp_path) if r.path.name.startswith("puff-psgd")]
    assert len(comp) == len(image_ranks.SEEDS)
    assert comp[0].flags[comp[0].flags.index("--powersgd-rank") + 1] == "2"
    assert "--powersgd-start-iter" in comp[0].flags


def test_lm_width_phase_runs_both_methods_at_two_lrs_then_pufferfish_at_full_rank_s_best(
        tmp_path: Path) -> None:
    import lm_width

    _finish(lm_budget.run_dir(tmp_path, 20.0, "full", 1e-2, 0), val_ppl=20.0, test_ppl=20.0)
    for m in ("full", "lowrank"):  # width 0.125's other LRs, so 1e-2 is full rank's choice
        for lr in (1e-3, 3e-3, 3e-2):
            _finish(lm_budget.run_dir(tmp_path, 20.0, m, lr, 0), val_ppl=30.0, test_ppl=30.0)
    assert lm_width.lrs(tmp_path) == [3e-3, 1e-2]  # around 1e-2 x 0.125 / 0.25
    todo = lm_width.queue(tmp_path)
    assert [(m, lr, w) for _, m, lr, _, w in todo] == [
        ("full", 3e-3, 0.25), ("lowrank", 3e-3, 0.25), ("full", 1e-2, 0.25),
        ("lowrank", 1e-2, 0.25)]
    for m, lr, val in (("full", 3e-3, 25.0), ("full", 1e-2, 26.0), ("lowrank", 3e-3, 40.0),
                       ("lowrank", 1e-2, 27.0)):
        _finish(lm_budget.run_dir(tmp_path, 20.0, m, lr, 0, 0.25), val_ppl=val, test_ppl=val)
    # Pufferfish at full rank's better LR; full and low rank 2 apart at width 0.125's spread 0
    assert [(m, lr, s) for _, m, lr, s, _ in lm_width.queue(tmp_path)] == [
        ("puff10auto", 3e-3, 0)]
    assert lm_width.verdict(tmp_path) is None  # a run to go
    _finish(lm_budget.run_dir(tmp_path, 20.0, "puff10auto", 3e-3, 0, 0.25), val_ppl=25.5,
            test_ppl=25.5)
    found = lm_width.verdict(tmp_path)  # low rank +2.00, Pufferfish +0.50, resolution 0
    assert found["default"] == "full" and "resolution 0.00" in found["text"]
    # Width 0.125's seeds at 1e-2 (val 20, 21.5, 22.5: spread 2.5, resolution 5): low rank's +2
    # is within it, so seed 1 of both runs before the verdict
    for seed, val in ((1, 21.5), (2, 22.5)):
        _finish(lm_budget.run_dir(tmp_path, 20.0, "full", 1e-2, seed), val_ppl=val, test_ppl=val)
    assert lm_width.resolution(tmp_path) == 5.0
    assert [(m, lr, s) for _, m, lr, s, _ in lm_width.queue(tmp_path)] == [
        ("full", 3e-3, 1), ("lowrank", 1e-2, 1)]
    for m, lr, val in (("full", 3e-3, 25.0), ("lowrank", 1e-2, 28.0)):
        _finish(lm_budget.run_dir(tmp_path, 20.0, m, lr, 1, 0.25), val_ppl=val, test_ppl=val)
    found = lm_width.verdict(tmp_path)  # low rank's mean 27.5 against 25.0: +2.5 <= 5
    assert found["default"] == "lowrank" and found["lrs"]["lowrank"] == 1e-2
    assert "lowrank 27.50 (lr 0.01, 2 seeds)" in found["text"]