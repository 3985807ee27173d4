"""``pufferfish bench --train`` says which run is training and how far it is, epoch by epoch."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import needs_fashion

from pufferfish.bench.progress import TrainingProgress, duration
from pufferfish.bench.step import cpu_name
from pufferfish.cli import main


def test_a_line_per_epoch_with_the_time_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    old = run / "metrics.jsonl"  # an earlier run's rows, about to be replaced: not reported
    old.write_text(json.dumps({"epoch": 1, "test_acc": 0.5}) + "\n")
    os.utime(old, (time.time() - 60, time.time() - 60))
    lines: list[str] = []
    with TrainingProgress(run, "pufferfish over 100mbit", 3, lines.append, every=0.02):
        time.sleep(0.1)
        assert lines == ["training pufferfish over 100mbit: 3 epochs"]
        for epoch in (1, 2):
            rows = [{"epoch": e, "test_acc": a} for e, a in ((1, 0.8), (2, 0.85))][:epoch]
            old.write_text("".join(json.dumps(r) + "\n" for r in rows))
            deadline = time.time() + 5
            while len(lines) < epoch + 1 and time.time() < deadline:
                time.sleep(0.02)
    assert len(lines) == 3, lines
    assert lines[1].startswith("training pufferfish over 100mbit: epoch 1/3, test accuracy "
                               "80.00%, ") and lines[1].endswith(" left")
    assert "epoch 2/3, test accuracy 85.00%" in lines[2]
    assert duration(42) == "42 s" and duration(220) == "3 min 40 s"
    assert duration(3900) == "1 h 05 min"


@needs_fashion
def test_bench_train_reports_each_epoch_of_each_run(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--train", "--methods", "ddp,pufferfish", "--epochs", "1",
               "--method-epochs", "pufferfish=2", "--warmup-epochs", "1", "--width", "0.125",
               "--batch-size", "32", "--train-subset", "256", "--test-subset", "64",
               "--threads", "1", "--bandwidth", "loopback", "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    for line in ("training ddp over loopback: 1 epoch", "training ddp over loopback: epoch 1/1",
                 "training pufferfish over loopback: epoch 1/2",
                 "training pufferfish over loopback: epoch 2/2"):
        assert line in out, out[-3000:]
    assert out.index("pufferfish over loopback: epoch 1/2") < out.index("epoch 2/2")
    # the records say which machine trained them: CPUs differ several-fold in compute
    machine = json.loads((tmp_path / "b" / "train_results.json").read_text())["machine"]
    assert machine["cpu"] == cpu_name() and ("gpu" in machine) == torch.cuda.is_available()
    assert f"Measured on: CPU ({cpu_name()})" in (tmp_path / "b" / "train.md").read_text()
