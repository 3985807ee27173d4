"""benchmarks/factor_spectrum.py on a real full-rank llama checkpoint: one row per factorized layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_llama import llama_args
from test_training import run_cli

from pufferfish.training.checkpoint import latest_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks/factor_spectrum.py"


def spectrum(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


def test_rows_compare_initialization_with_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "full"
    trained = run_cli("train", *llama_args(tmp_path, "--mode", "full", "--epochs", "1",
                                           "--out", str(out)))
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = spectrum(str(latest_checkpoint(out)[1]))
    assert result.returncode == 0, result.stderr
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
            if line.startswith("| layers.")]
    # the paper preset keeps block 0: every other block's seven projections are factorized
    assert rows and all(not r[0].strip().startswith("layers.0.") for r in rows)
    assert len(rows) % 7 == 0
    for row in rows:
        spread, energy = (cell.split("->") for cell in (row[2], row[5]))
        assert all(float(s) >= 1.0 for s in spread)
        assert all(0.0 < float(e) <= 1.0 for e in energy)
    assert any(float(a) != float(b) for a, b in (r[6].split("->") for r in rows))


def test_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = spectrum(str(tmp_path / "ckpt-000000001.pt"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"factor_spectrum: checkpoint {str(tmp_path / 'ckpt-000000001.pt')!r} is not a file: "
        "allowed a ckpt-*.pt of a full-rank run"]
