"""``report``, ``compare`` and ``bench`` never replace another command's (or the user's) outputs
unasked: they refuse in one line before doing any work, or replace with ``--overwrite``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pufferfish.cli import main
from pufferfish.configfile import dump_toml, load_config
from pufferfish.outputs import RECORD, claim_outputs, owners
from pufferfish.training.metrics import MetricsWriter


def _run(path: Path) -> Path:
    """A finished `pufferfish train` run directory (config.toml, metrics.jsonl)."""
    path.mkdir(parents=True)
    path.joinpath("config.toml").write_text(dump_toml(load_config(None, {"mode": "full"})))
    writer = MetricsWriter(path)
    for epoch, acc in ((1, 0.8), (2, 0.85)):
        writer.write({"epoch": epoch, "test_acc": acc, "lowrank": False, "params": 1000,
                      "macs": 5000, "epoch_time": 1.0})
    return path


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pufferfish: error:"), err
    return err


def test_report_on_a_missing_or_foreign_directory(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "'" + str(tmp_path / "nope") + "' does not exist" in _one_line_error(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl: not a `pufferfish train` run" in _one_line_error(capsys)


def test_report_and_compare_do_not_replace_each_others_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, out = _run(tmp_path / "a"), tmp_path / "cmp"
    assert main(["report", str(run), "--out", str(out)]) == 0
    first = (out / "report.md").read_text()
    assert owners(out)["report.md"] == "report"
    assert main(["report", str(run), "--out", str(out)]) == 0  # its own: refreshed
    # compare refuses before training anything: no run directory appears.
    assert main(["compare", "--out", str(out), "--epochs", "1", "--methods", "full"]) == 2
    err = _one_line_error(capsys)
    assert "report.md" in err and "written by report" in err and "--overwrite" in err
    assert (out / "report.md").read_text() == first and not (out / "full").exists()
    # ...and report refuses compare's report.md the same way.
    claim_outputs(tmp_path / "c2", "compare", ["report.md"])
    (tmp_path / "c2" / "report.md").write_text("compare's")
    assert main(["report", str(run), "--out", str(tmp_path / "c2")]) == 2
    assert "written by compare" in _one_line_error(capsys)
    assert (tmp_path / "c2" / "report.md").read_text() == "compare's"
    assert main(["report", str(run), "--out", str(tmp_path / "c2"), "--overwrite"]) == 0
    assert owners(tmp_path / "c2")["report.md"] == "report"


def test_a_users_own_file_is_never_replaced_unasked(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run, out = _run(tmp_path / "a"), tmp_path / "mine"
    out.mkdir()
    (out / "accuracy.png").write_text("my plot")
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert "accuracy.png (written by unknown)" in _one_line_error(capsys)
    assert (out / "accuracy.png").read_text() == "my plot" and not (out / "report.md").exists()
    (tmp_path / "file").write_text("x")
    assert main(["report", str(run), "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in _one_line_error(capsys)
    assert main(["report", str(run), "--out", str(tmp_path / "file" / "under")]) == 2
    assert "cannot be made (" in _one_line_error(capsys)  # not an OS error's bare text
    assert (tmp_path / "file").read_text() == "x"


def test_bench_refuses_files_it_did_not_write(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.md").write_text("notes")
    # The refusal comes before anything is read or measured (the results path does not exist).
    assert main(["bench", "--from-results", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "no " in _one_line_error(capsys)  # validation first: the bad --from-results
    saved = tmp_path / "saved"
    claim_outputs(saved, "bench", ["results.json"])
    (saved / "results.json").write_text(json.dumps({"config": {"methods": ["ddp"]}, "rows": [],
                                                    "rounds": [], "links": [], "order": [],
                                                    "skipped": [], "failures": []}))
    assert main(["bench", "--from-results", str(saved), "--methods", "ddp", "--out", str(out)]) == 2
    assert "results.md (written by unknown)" in _one_line_error(capsys)
    assert (out / "results.md").read_text() == "notes"
    assert json.loads((out / RECORD).read_text() if (out / RECORD).exists() else "{}") == {}
