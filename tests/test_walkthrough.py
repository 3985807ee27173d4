"""A new user's walkthrough (issue 35): each trap it found, as the user met it, stays fixed.

Every test here is small and fast: no training longer than a few steps, `--threads 1`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_corpus

from pufferfish.cli import main
from pufferfish.configfile import dump_toml, load_config
from pufferfish.lowrank import svd_split
from pufferfish.outputs import RECORD, owners
from pufferfish.switch import SwitchSchedule
from pufferfish.training.metrics import MetricsWriter
from pufferfish.training.rundir import record_run


def _run(path: Path, rows: list[dict[str, object]], **cfg: object) -> Path:
    """A finished `pufferfish train` run directory (config.toml, metrics.jsonl)."""
    path.mkdir(parents=True)
    path.joinpath("config.toml").write_text(dump_toml(load_config(None, {"mode": "full", **cfg})))
    writer = MetricsWriter(path)
    for epoch, row in enumerate(rows, 1):
        writer.write({"epoch": epoch, "lowrank": False, "params": 1000, "macs": 5000,
                      "epoch_time": 1.0, **row})
    return path


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pufferfish: error:"), err
    return err


# -- 1. report: each run's quality by its own key; nothing half-written ---------------------------

def test_report_of_an_lm_beside_an_image_run(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    image = _run(tmp_path / "image", [{"test_acc": 0.8}, {"test_acc": 0.9}])
    lm = _run(tmp_path / "lm", [{"val_ppl": 2500.0}, {"val_ppl": 2066.2148}],
              model="llama", data="kjv")
    out = tmp_path / "report"
    assert main(["report", str(image), str(lm), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "final quality" in table and "90.00% test acc" in table
    assert "2066.21 val ppl" in table and "206621" not in table
    assert {p.name for p in out.iterdir()} == {"report.md", "accuracy.png", RECORD}
    assert "2066.21 val ppl" in (out / "report.md").read_text()


def test_a_failing_report_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from pufferfish import report

    run = _run(tmp_path / "a", [{"test_acc": 0.8}])

    def broken(runs: object) -> dict[str, bytes]:
        raise ValueError("plot failed")

    monkeypatch.setattr(report, "_plot", broken)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "plot failed" in _error(capsys)
    assert not (tmp_path / "out").exists()  # not even the record of the outputs


# -- 2. a report.md edited since the report wrote it is not replaced unasked ------------------------

def test_an_edited_report_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = _run(tmp_path / "a", [{"test_acc": 0.8}]), tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert main(["report", str(run), "--out", str(out)]) == 0  # unchanged: refreshed
    (out / "report.md").write_text("my notes")
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = _error(capsys)
    assert "report.md (written by report, changed since)" in err and "--overwrite" in err
    assert (out / "report.md").read_text() == "my notes"
    assert main(["report", str(run), "--out", str(out), "--overwrite"]) == 0
    assert "80.00%" in (out / "report.md").read_text() and owners(out)["report.md"] == "report"
    record = json.loads((out / RECORD).read_text())
    assert len(record["report.md"]["sha256"]) == 64


def test_a_record_of_an_older_version_still_reads(tmp_path: Path) -> None:
    run, out = _run(tmp_path / "a", [{"test_acc": 0.8}]), tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("old report")
    (out / RECORD).write_text(json.dumps({"report.md": "report"}))
    assert owners(out) == {"report.md": "report"}
    assert main(["report", str(run), "--out", str(out)]) == 0


# -- 3. factorize: --threads, and the SVD of wide layers without LAPACK's slow path --------------

def test_factorize_takes_threads(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(["factorize", "--model", "resnet18", "--width", "0.125", "--threads", "1"]) == 0
    assert calls == [1] and "== resnet18 (width 0.125" in capsys.readouterr().out
    assert main(["factorize", "--model", "resnet18", "--threads", "-1"]) == 2
    assert "--threads -1 is invalid" in _error(capsys)
    from pufferfish.distributed.env import idle_cpus

    assert 1 <= idle_cpus() <= torch.get_num_threads()


@pytest.mark.parametrize("shape", [(16, 144), (144, 16), (12, 12), (5, 9)])
def test_svd_split_of_wide_and_tall_weights_is_still_the_best_and_balanced(
        shape: tuple[int, int]) -> None:
    w = torch.randn(*shape)
    left, right = svd_split(w, 4)
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :4] * s[:4]) @ vh[:4]
    torch.testing.assert_close((left.double() @ right.double()), best, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.linalg.svdvals(left), torch.linalg.svdvals(right))
    full = svd_split(w, min(shape))
    torch.testing.assert_close(full[0] @ full[1], w, atol=1e-5, rtol=1e-5)


def test_svd_split_of_a_rank_deficient_wide_weight() -> None:
    w = torch.zeros(4, 40)
    w[0, 0] = 3.0  # rank 1: the Gram matrix's small eigenvalues say nothing; the SVD is taken
    left, right = svd_split(w, 2)
    assert torch.isfinite(left).all() and torch.isfinite(right).all()
    torch.testing.assert_close(left @ right, w)


# -- 4. uneven validation: one line, naming the flag as typed ----------------------------------

@pytest.mark.parametrize("width", ["0", "-1"])
def test_factorize_refuses_a_width_that_is_not_positive(
        width: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["factorize", "--model", "resnet18", "--width", width]) == 2
    assert f"--width {float(width)} is invalid: allowed > 0" in _error(capsys)


def _lm(tmp_path: Path, *extra: str) -> list[str]:

    return ["train", "--model", "llama", "--width", "0.0625", "--data",
            str(tiny_corpus(tmp_path)), "--cache-dir", str(tmp_path / "cache"), "--vocab-size",
            "280", "--seq-len", "16", "--batch-size", "4", "--threads", "1", "--no-progress",
            "--out", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("flag", ["--train-subset", "--test-subset"])
def test_llama_refuses_a_subset_larger_than_its_data(
        tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_lm(tmp_path, flag, "999999999")) == 2
    err = _error(capsys)
    split = "training" if flag == "--train-subset" else "validation"
    assert f"{flag} 999999999 is invalid: allowed 0 (all) to " in err
    assert f"tokens of {tmp_path / 'corpus.txt'})" in err and split in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("model", ["resnet18", "lstm", "llama"])
def test_a_missing_data_file_is_said_to_be_missing(
        tmp_path: Path, model: str, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.txt")
    assert main(["train", "--model", model, "--data", missing, "--epochs", "1",
                 "--out", str(tmp_path / "run")]) == 2
    assert f"--data '{missing}' does not exist: allowed" in _error(capsys)


def test_out_naming_a_file_and_missing_cifar(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("mine")
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "file")]) == 2
    assert f"--out '{tmp_path / 'file'}' is a file: allowed a directory" in _error(capsys)
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "file" / "run")]) == 2
    said = _error(capsys)  # the reason in the system's words (its locale's)
    assert f"--out '{tmp_path / 'file' / 'run'}' cannot be made (" in said
    assert "): allowed a directory this user can create and write" in said
    assert (tmp_path / "file").read_text() == "mine"
    from pufferfish.data import DataError, load_dataset

    with pytest.raises(DataError, match=r"fetch it: --download, or pufferfish\.data\.download"):
        load_dataset("cifar10", tmp_path / "none")


def test_errors_name_the_flag_or_the_key_as_the_user_wrote_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "run")]
    assert main(["train", "--rank-ratio", "2", *out]) == 2
    assert "error: --rank-ratio 2.0 is out of range" in _error(capsys)
    toml = tmp_path / "c.toml"
    toml.write_text('rank_ratio = "2"\n')
    assert main(["train", "--config", str(toml), *out]) == 2
    assert "error: rank_ratio 2.0 is out of range" in _error(capsys)
    assert main(["train", "--mode", "galore", "--rank-ratio", "auto", *out]) == 2
    assert "--rank-ratio 'auto' is invalid with --mode 'galore'" in _error(capsys)
    assert main(["train", "--resume", "auto", "--overwrite", *out]) == 2
    assert "error: --overwrite is invalid with --resume 'auto'" in _error(capsys)


# -- 5. a run stopped before its first checkpoint -----------------------------------------------

def test_a_run_without_a_checkpoint_is_refused_with_the_step_that_works(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(load_config(None, {"out": str(run)})))
    record_run(run)  # a run's config.toml by the outputs record, as the run wrote it
    assert main(["train", "--epochs", "1", "--out", str(run)]) == 2
    err = _error(capsys)
    assert "stopped before its first checkpoint (config.toml)" in err
    assert "start it anew there with --overwrite" in err and "--resume" not in err
    assert (run / "config.toml").exists()


# -- 6. the warm-up of a 1-epoch run, and its banner ---------------------------------------------

def test_a_share_warmup_of_one_epoch_switches_in_steps() -> None:
    from pufferfish.method import PufferfishMethod

    def when(**flags: object) -> SwitchSchedule:
        return SwitchSchedule.from_config(load_config(None, flags))

    one = when(epochs=1)
    assert one.share_in_steps == 0.1 and one.switch_step(50) == 5
    assert PufferfishMethod(load_config(None, {"epochs": 1})).schedule.in_steps
    assert not when(epochs=1, warmup_epochs="0%").in_steps  # the switch before step 0
    assert when(epochs=1, warmup_epochs="0%").switch_step(50) == 0
    assert not when(epochs=2).in_steps and when(epochs=2).switch_step(50) == 50  # epoch 1 of 2
    assert when(epochs=1, warmup_steps=7).switch_step(50) == 7


def test_a_short_run_scales_its_milestones_and_warm_up_to_its_steps() -> None:
    """A 1-epoch try of the paper's schedule: full LR from step 0, x0.1 half-way, x0.01 at 3/4
    (the nearest epoch boundary, epoch 0, would decay from the first step); a 10% warm-up of 4
    steps switches after one full-rank step. Runs of whole epochs keep epoch milestones."""
    from pufferfish.training.schedule import lr_at

    one = load_config(None, {"epochs": 1, "lr": 0.1, "warmup_epochs": "10%"})
    assert [lr_at(one, s, 8) for s in range(8)] == pytest.approx([0.1] * 4 + [0.01] * 2
                                                                  + [0.001] * 2)
    assert [SwitchSchedule.from_config(one).switch_step(n) for n in (4, 50)] == [1, 5]
    two = load_config(None, {"epochs": 2, "lr": 0.1})
    assert [lr_at(two, s, 4) for s in (0, 3, 4, 5, 6)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001])  # epoch 1, then 75% of the steps: step 6
    twenty = load_config(None, {"epochs": 20, "lr": 0.1})
    assert [lr_at(twenty, s, 10) for s in (99, 100, 149, 150)] == pytest.approx(
        [0.1, 0.01, 0.01, 0.001])  # epochs 10 and 15, as before


def test_the_warmup_banner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    from pufferfish.training.metrics import read_metrics

    data = str(tiny_corpus(tmp_path))
    run = tmp_path / "run"
    args = ["train", "--model", "transformer", "--width", "0.125", "--data", data,
            "--batch-size", "4", "--bptt", "10", "--train-subset", "400", "--test-subset", "100",
            "--threads", "1", "--no-progress", "--out", str(run)]
    assert main([*args, "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "warm-up: 10% of 1 epoch is no whole epoch: full rank for the first 1 of its 10 " \
           "optimizer steps, then the switch (mid-epoch)" in out
    assert "switching to the low-rank model at step 1 (epoch 0, step 1)" in out  # of 10 steps
    assert read_metrics(run)[0]["lowrank"] is True
    assert main([*args, "--epochs", "5", "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "warm-up: 10% of 5 epochs = 1 full-rank epoch before the switch" in out
    assert main(["train", "--resume", str(run), "--epochs", "6", "--threads", "1"]) == 0
    assert "warm-up:" not in capsys.readouterr().out  # it switched long ago


# -- 7. compare's LTH bar counts the run's epochs --------------------------------------------------

def test_the_progress_bar_counts_every_epoch_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bar over the run (LTH: every round's epochs), a resumed run's steps already done."""
    from pufferfish.distributed.env import DistEnv
    from pufferfish.training import progressbar

    seen = []
    monkeypatch.setattr(progressbar, "tqdm", lambda **kw: seen.append(kw))
    cfg = load_config(None, {"mode": "lth", "epochs": 2})
    progressbar.run_bar(cfg, DistEnv(), 13, 10, 6)  # 6 epochs of 10 steps
    assert seen[0]["total"] == 60 and seen[0]["initial"] == 13
