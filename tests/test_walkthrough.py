"""A new user's walkthrough (issue 35): each trap it found, as the user met it, stays fixed.

Every test here is small and fast: no training longer than a few steps, `--threads 1`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pufferfish.cli import main
from pufferfish.config import dump_toml, load_config
from pufferfish.lowrank import svd_split
from pufferfish.outputs import RECORD, owners
from pufferfish.training.metrics import MetricsWriter


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
    from pufferfish.training import report

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
