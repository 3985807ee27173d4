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


def test_ranks_measure_how_evenly_a_factor_pair_uses_its_rank(tmp_path: Path) -> None:
    """A factor pair whose product has equal singular values uses all r directions (effective
    and stable rank r); one of rank 1 uses one; a dense weight is measured on its top r."""
    import torch

    from pufferfish.training.checkpoint import save_checkpoint

    eye = torch.eye(16)
    model = {"a.q_proj.u.weight": torch.cat([eye, torch.zeros(48, 16)]),  # 64x16
             "a.q_proj.v.weight": torch.cat([eye, torch.zeros(16, 48)], dim=1),  # 16x64
             "a.k_proj.u.weight": torch.ones(64, 16) / 8, "a.k_proj.v.weight": torch.ones(16, 64),
             "a.v_proj.weight": torch.diag(torch.linspace(4.0, 1.0, 64))}
    ckpt = save_checkpoint(tmp_path, {"config": {"rank_ratio": "0.25"}, "model": model}, step=1)
    result = spectrum("--ranks", str(ckpt))
    assert result.returncode == 0, result.stderr
    header, row = (line.strip("|").split("|") for line in result.stdout.splitlines()
                   if line.startswith("| checkpoint") or line.startswith(f"| {ckpt}"))
    cells = {k.strip(): tuple(map(float, v.split("/"))) for k, v in zip(header[1:], row[1:],
                                                                          strict=True)}
    assert cells["q_proj"] == (16.0, 16.0)
    assert cells["k_proj"][0] == 1.0 and cells["k_proj"][1] == 1.0
    assert 15.0 < cells["v_proj"][0] <= 16.0 and 10.0 < cells["v_proj"][1] < 16.0
    missing = spectrum("--ranks", str(tmp_path / "nope.pt"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
