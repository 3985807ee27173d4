"""benchmarks/factor_spectrum.py and switch_moments.py on a real full-rank llama checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import llama_args, run_cli

from pufferfish.training.checkpoint import latest_checkpoint

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "factor_spectrum.py"


def spectrum(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-rank llama run's last checkpoint (AdamW, the LM default)."""
    tmp_path = tmp_path_factory.mktemp("llama")
    out = tmp_path / "full"
    trained = run_cli("train", *llama_args(tmp_path, "--mode", "full", "--epochs", "1",
                                           "--out", str(out)))
    assert trained.returncode == 0, trained.stderr[-3000:]
    return latest_checkpoint(out)[1]


def test_rows_compare_initialization_with_the_checkpoint(full_checkpoint: Path) -> None:
    result = spectrum(str(full_checkpoint))
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


def test_switch_moments_compare_the_projected_second_moment_with_measured_gradients(
        full_checkpoint: Path) -> None:
    """Every factor of the preset's layers gets a row; ratios are positive and finite, and the
    correlated bound is never below the uncorrelated projection (Minkowski)."""
    result = spectrum(str(full_checkpoint), "--batches", "2", script=BENCH / "switch_moments.py")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
            if line.startswith("| ") and "_proj." in line]
    kinds = {r[0].strip() for r in rows}
    assert kinds == {f"{k}_proj.{f}" for k in ("q", "k", "v", "o", "gate", "up", "down")
                     for f in ("u", "v")}
    for row in rows:
        projected, bound, dense = (float(c) for c in row[1:4])
        assert 0 < projected <= bound * (1 + 1e-6) and 0 < dense < float("inf")
