"""benchmarks/sweep.py, the study drivers' one run queue, and the studies built on it: a run is
finished by its test metric, resumed from its checkpoint, and phase choices follow validation."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import DDP_ROWS, PUFF_ROWS, write_train_run

from pufferfish.training.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import image_ranks  # noqa: E402
import lm_budget  # noqa: E402
import sweep  # noqa: E402
import sweeps  # noqa: E402


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
    (tmp_path / "b" / "config.toml").write_text("epochs = 20\n")  # an image run, stopped
    _rows = [{"epoch": e, "test_acc": 0.9} for e in (15, 16)]  # at epoch 16 of its 20
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows))
    assert sweep.finished(tmp_path / "b") is None
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 20, "test_acc": 0.91}) + "\n")
    assert sweep.finished(tmp_path / "b")["test_acc"] == 0.91
    assert sweep._quality({"test_ppl": 20.0}) == " val nan test 20.00"  # no validation split
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
    found = lm_width.verdict(tmp_path)  # low rank +8%, Pufferfish +2%, resolution 0
    assert found["default"] == "pufferfish" and "resolution 0.0%" in found["text"]
    assert "it costs 2.0% against full rank, beyond the resolution" in found["text"]
    # Width 0.125's seeds at 1e-2 (val 20, 21.5, 22.5: spread 2.5 of mean 21.33, resolution
    # 23.4%): low rank's +8% is within it, so seed 1 of both runs before the verdict
    for seed, val in ((1, 21.5), (2, 22.5)):
        _finish(lm_budget.run_dir(tmp_path, 20.0, "full", 1e-2, seed), val_ppl=val, test_ppl=val)
    assert lm_width.resolution(tmp_path) == pytest.approx(2 * 2.5 / (64 / 3))
    assert [(m, lr, s) for _, m, lr, s, _ in lm_width.queue(tmp_path)] == [
        ("full", 3e-3, 1), ("lowrank", 1e-2, 1)]
    for m, lr, val in (("full", 3e-3, 25.0), ("lowrank", 1e-2, 28.0)):
        _finish(lm_budget.run_dir(tmp_path, 20.0, m, lr, 1, 0.25), val_ppl=val, test_ppl=val)
    found = lm_width.verdict(tmp_path)  # low rank's mean 27.5 against 25.0: +10% <= 23.4%
    # low rank +10%, Pufferfish +2% (one seed): Pufferfish, within the resolution of each other
    assert found["default"] == "pufferfish" and found["lrs"]["lowrank"] == 1e-2
    assert "lowrank 27.50 (lr 0.01, 2 seeds)" in found["text"]
    assert "a point estimate within the resolution" in found["text"]
    assert "costs" not in found["text"]


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[tuple[str, str]]:
    """``sweeps.py``'s dry run: (run name, its command line from ``train`` on) per queued run."""
    assert sweeps.main([argv[0], "--dry-run", *argv[1:]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("would run: ") for line in lines)
    rows = [line.removeprefix("would run: ").split(": ", 1) for line in lines]
    return [(Path(path).name, cmd[cmd.index(" train ") + 1:]) for path, cmd in rows]


def test_grid_queues_the_shell_grid_s_runs_in_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grid"
    runs = _dry_run(["grid", "configs/lstm_kjv.toml", str(out), "--warmups", "1,4",
                     "--ratios", "0.25", "--epochs", "2", "--seed", "1"], capsys)
    base = "train --config configs/lstm_kjv.toml --no-progress --epochs 2 --seed 1"
    puff = "--mode pufferfish --warmup-epochs"
    assert runs == [  # grid.sh's runs: full, each w x r, auto; the extra flags before the mode
        ("full", f"{base} --mode full --out {out}/full"),
        ("w1-r0.25", f"{base} {puff} 1 --rank-ratio 0.25 --out {out}/w1-r0.25"),
        ("w4-r0.25", f"{base} {puff} 4 --rank-ratio 0.25 --out {out}/w4-r0.25"),
        ("auto", f"{base} {puff} auto --rank-ratio auto --keep auto --out {out}/auto")]
    assert {r.nproc for r in sweeps.grid("c", out, ["1"], ["0.5"])} == {1}
    assert "torch.distributed.run" not in sweep.command(sweeps.grid("c", out, ["1"], ["0.5"])[0])
    _finish(out / "full", test_ppl=50.0)  # the cache: a finished run is not queued again
    assert [name for name, _ in _dry_run(["grid", "c", str(out)], capsys)][:2] == [
        "w1-r0.125", "w1-r0.25"]


def test_llama_lr_queues_seed_lr_method_runs_on_two_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _dry_run(["llama-lr", str(tmp_path), "--lrs", "0.001,0.003", "--methods",
                     "full,pufferfish", "--seeds", "0,1", "--", "--epochs", "1"], capsys)
    assert [name for name, _ in runs] == [
        f"{m}-lr{lr}-s{s}" for s in (0, 1) for lr in ("0.001", "0.003")
        for m in ("full", "pufferfish")]
    llama = ("--model llama --data kjv --width 0.25 --seq-len 128 --vocab-size 4096 "
             "--batch-size 8 --eval-every-steps 100 --bucket-mb torch --epochs 1")
    assert runs[3][1] == (f"train {llama} --mode pufferfish --warmup-steps 0.25 --lr 0.003 "
                          f"--seed 0 --threads 1 --no-progress --out {tmp_path}/pufferfish-lr0.003-s0")
    queued = sweeps.llama_lr(tmp_path, ["0.001"], ["galore"], ["0"])
    assert [r.nproc for r in queued] == [2] and "--nproc-per-node" in sweep.command(queued[0])


def test_diloco_queues_one_run_per_method_with_h_on_diloco_s_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = dict(_dry_run(["diloco", str(tmp_path), "--h", "30", "--config",
                          "configs/transformer_kjv.toml"], capsys))
    assert list(runs) == list(sweeps.DILOCO_METHODS)  # diloco.sh's default METHODS
    tail = "--threads 1 --no-progress --out"
    flags = {m: cmd.removeprefix("train --config configs/transformer_kjv.toml ").split(f" {tail}")[0]
             for m, cmd in runs.items()}
    assert flags == {
        "ddp": "--mode full", "powersgd": "--mode full --comm powersgd",
        "pufferfish": "--mode pufferfish", "diloco": "--mode full --sync diloco --inner-steps 30",
        "pufferfish+diloco": "--mode pufferfish --sync diloco --inner-steps 30",
        "pufferfish+diloco-project": "--mode pufferfish --sync diloco --inner-steps 30 "
                                     "--outer-switch-momentum project"}
    assert {r.nproc for r in sweeps.diloco(tmp_path, ["ddp"], "10")} == {2}


def test_accuracy_queues_one_run_per_mode_reports_them_and_refuses_an_unknown_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _dry_run(["accuracy", "configs/resnet18_fashion.toml", str(tmp_path), "--modes",
                     "full,lowrank", "--train-subset", "8000"], capsys)
    assert runs == [(m, f"train --config configs/resnet18_fashion.toml --mode {m} --no-progress "
                        f"--train-subset 8000 --out {tmp_path}/{m}") for m in ("full", "lowrank")]
    assert {r.nproc for r in sweeps.accuracy("c", tmp_path, ["full"])} == {2}
    with pytest.raises(SystemExit) as bad:
        sweeps.main(["accuracy", "c", str(tmp_path), "--modes", "full,galore"])
    assert bad.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "galore" in err and "full, pufferfish, lowrank" in err
    for mode, rows in (("full", DDP_ROWS), ("lowrank", PUFF_ROWS)):  # finished: the report only
        write_train_run(tmp_path / mode, [{**r, "params": 1000, "macs": 10} for r in rows], mode=mode)
    assert sweeps.main(["accuracy", "c", str(tmp_path), "--modes", "full,lowrank"]) == 0
    assert "lowrank" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob("*.log"))


def test_cache_copies_finished_runs_records_only_and_never_overwrites(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _finish(runs / "a", test_acc=0.9)
    (runs / "a" / "config.toml").write_text("epochs = 1\n")
    (runs / "a" / "notes.txt").write_text("the user's")  # not a run's file
    save_checkpoint(runs / "a", {"w": torch.zeros(2)}, 100)
    (runs / "b").mkdir()  # not finished: not cached
    dest = tmp_path / "cache"
    assert sweep.cache([runs / "a", runs / "b"], dest) == [dest / "a"]
    assert sorted(p.name for p in (dest / "a").iterdir()) == ["config.toml", "metrics.jsonl"]
    assert sweep.cache([runs / "a"], dest) == [dest / "a"]  # the same again: kept
    (dest / "a" / "metrics.jsonl").write_text("cached before\n")
    (dest / "a" / "config.toml").unlink()
    with pytest.raises(SystemExit, match="cached already and differs"):
        sweep.cache([runs / "a"], dest)
    assert (dest / "a" / "metrics.jsonl").read_text() == "cached before\n"
    assert not (dest / "a" / "config.toml").exists()  # every file checked before any copied
    _finish(runs / "c", test_acc=0.9)  # metrics without the config of a train run
    with pytest.raises(SystemExit, match=r"no config\.toml and metrics\.jsonl"):
        sweep.cache([runs / "c"], tmp_path / "cache2")


def test_a_study_started_again_from_its_cache_resumes(tmp_path: Path) -> None:
    runs, dest = tmp_path / "runs", tmp_path / "cache"
    for name in ("a", "b"):
        _finish(runs / name, test_acc=0.9)
        (runs / name / "config.toml").write_text("epochs = 1\n")
        save_checkpoint(runs / name, {"w": torch.zeros(2)}, 100)  # the run's record
    assert sweep.cache([runs / "a"], dest) == [dest / "a"]
    fresh = tmp_path / "fresh"  # a new machine: OUT started from the cache's records
    shutil.copytree(dest, fresh)
    shutil.copytree(runs / "b", fresh / "b")  # and trained on
    assert sweep.finished(fresh / "a") is not None  # not trained again
    assert sweep.cache([fresh / "a", fresh / "b"], dest) == [dest / "b"]  # a: cached already
    (fresh / "a" / "config.toml").write_text("epochs = 1\n# edited\n")  # not the cached one
    with pytest.raises(SystemExit, match=r"a/config\.toml is cached already and differs"):
        sweep.cache([fresh / "a"], dest)
    with pytest.raises(SystemExit, match=r"no config\.toml and metrics\.jsonl"):  # elsewhere
        sweep.cache([fresh / "a"], tmp_path / "cache2")
