"""What a run prints and logs: ``--logger tensorboard`` event files (steps, epochs, the switch; a
resume hides what it redoes), the short default start (the configuration under ``--verbose``),
and every ``train`` flag getting through torchrun's own parser to ``pufferfish train``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from helpers import TINY, cli, metrics, needs_fashion

from pufferfish.cli import _parser
from pufferfish.config import TrainConfig
from pufferfish.distributed.env import DistEnv
from pufferfish.outputs import RECORD
from pufferfish.training.build import write_config
from pufferfish.training.rundir import record_run
from pufferfish.training.startup import _remove, run_files


def _train_options() -> list[str]:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            train = action.choices["train"]
            return [o for a in train._actions for o in a.option_strings
                    if o.startswith("--") and o != "--help"]
    raise AssertionError("no train command")


def test_every_train_flag_gets_through_torchrun() -> None:
    """torchrun's parser matches abbreviations: a script flag that is a prefix of two of its
    options (``--log``: ``--log-dir``, ``--logs-specs``) is refused as ambiguous before the
    script starts. Each flag of ``pufferfish train`` must reach the script untouched."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    head = ["--nproc-per-node", "2", "-m", "pufferfish", "train"]
    baseline = vars(parser.parse_args(head))
    options = _train_options()
    assert {"--logger", "--verbose", "--epochs", "--no-progress"} <= set(options)
    for flag in options:
        for tail in ([flag, "7"], [f"{flag}=7"]):
            try:
                parsed = vars(parser.parse_args([*head, *tail]))
            except SystemExit:
                pytest.fail(f"torchrun refuses `-m pufferfish train {' '.join(tail)}`")
            assert parsed.pop("training_script_args") == ["train", *tail], flag
            assert parsed == {k: v for k, v in baseline.items()
                              if k != "training_script_args"}, flag


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@needs_fashion
def test_tensorboard_logs_steps_epochs_and_the_switch_and_a_resume_redoes_none_twice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"  # 8 steps an epoch, the switch before step 9
    code, stdout, err = cli(["train", *TINY, "--epochs", "2", "--warmup-epochs", "1",
                             "--out", str(out), "--logger", "tensorboard"], capsys)
    assert code == 0, err
    start = stdout.split("epoch 1/2")[0].splitlines()
    assert len(start) <= 3 and "  model = " not in stdout, start  # no config dump
    assert f"configuration: {out / 'config.toml'} (--verbose prints it)" in start
    rows = metrics(out)
    board = _scalars(out / "tb")
    assert [s for s, _ in board["step/loss"]] == list(range(1, 17))
    assert [s for s, _ in board["step/lr"]] == list(range(1, 17))
    assert "step/time_s" in board and "step/comm_bytes" in board
    assert board["epoch/train_loss"] == [(8, pytest.approx(rows[0]["train_loss"])),
                                         (16, pytest.approx(rows[1]["train_loss"]))]
    assert [s for s, _ in board["epoch/test_acc"]] == [8, 16]
    assert board["factorization/params_before"] == [(9, rows[0]["params"])]
    assert board["factorization/params_after"] == [(9, rows[1]["params"])]

    # The newest checkpoint broken: the resumed run redoes epoch 2 (and the switch), warns in
    # the first lines it prints, and the board shows each step and epoch once.
    newest = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    newest.write_bytes(b"other data" * 100)
    code, stdout, err = cli(["train", "--resume", str(out)], capsys)
    assert code == 0, err
    start = stdout.split("switching to the low-rank model")[0].splitlines()
    assert len(start) <= 4 and start[0].startswith("pufferfish: warning: skipped checkpoint"), start
    board = _scalars(out / "tb")
    assert [s for s, _ in board["step/loss"]] == list(range(1, 17))
    assert [s for s, _ in board["epoch/train_loss"]] == [8, 16]
    assert [s for s, _ in board["factorization/params_after"]] == [9]


def test_verbose_prints_the_whole_configuration(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainConfig(epochs=3, width=0.5, lr=0.01, verbose=True, out=str(tmp_path))
    write_config(cfg, DistEnv(), tmp_path)
    printed = capsys.readouterr().out
    assert "configuration:\n  model = \"resnet18\"\n" in printed and "  lr = 0.01\n" in printed
    assert "resnet18 (width 0.5) on fashion-mnist, mode pufferfish, 3 epochs" in printed
    assert "lr = 0.01" in (tmp_path / "config.toml").read_text()


def test_a_missing_tensorboard_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    out = tmp_path / "run"
    code, _, err = cli(["train", *TINY, "--out", str(out), "--logger", "tensorboard"], capsys)
    assert code == 2 and err == ("pufferfish: error: --logger 'tensorboard' needs the tensorboard "
                                 "package, which is not installed: pip install tensorboard (or "
                                 "use --logger 'none')\n")  # named as typed: the flag
    assert not out.exists()


def test_overwrite_removes_the_event_files_too(tmp_path: Path) -> None:
    (tmp_path / "tb").mkdir()
    events = tmp_path / "tb" / "events.out.tfevents.1.host.1.0"
    events.write_bytes(b"x")
    (tmp_path / "config.toml").write_text("")
    assert run_files(tmp_path) == []  # named like a run's, but no run's by the record
    record_run(tmp_path)
    assert run_files(tmp_path) == [tmp_path / "config.toml", events]  # an earlier run's
    _remove(tmp_path, run_files(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]
