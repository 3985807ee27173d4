"""benchmarks/diloco_tta.py on the cached llama runs: the documented table is what the command prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks/results/diloco-llama-w0.25-kjv-e1"
SCRIPT = ROOT / "benchmarks/diloco_tta.py"


def tta(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(RUNS), "--target", "4.7622", *args],
                          capture_output=True, text=True, timeout=60)


def row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_compute_like_times_a_run_at_its_reference_compute() -> None:
    own, like = tta(), tta("--compute-like", "diloco=ddp,pufferfish+diloco=pufferfish")
    assert own.returncode == like.returncode == 0, own.stderr + like.stderr
    # docs/benchmarks.md, "llama with AdamW inner steps": 1 Gbit/s, 100 Mbit/s, 10 Mbit/s
    assert row(like.stdout, "pufferfish+diloco")[-3:] == ["132 s", "156 s", "394 s"]
    assert row(like.stdout, "diloco")[-3:] == ["178 s", "209 s", "520 s"]
    # bytes and the step of the target do not depend on whose compute is used; the times do
    assert row(own.stdout, "diloco")[:5] == row(like.stdout, "diloco")[:5]
    assert row(own.stdout, "diloco")[-1] != row(like.stdout, "diloco")[-1]
    assert row(own.stdout, "ddp") == row(like.stdout, "ddp")


def test_an_unknown_reference_is_one_line_and_exit_2() -> None:
    bad = tta("--compute-like", "diloco=nope")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "--compute-like diloco=nope" in bad.stderr


def test_interpolate_finds_the_crossing_between_two_evaluations() -> None:
    first, line = tta(), tta("--interpolate")
    assert first.returncode == line.returncode == 0, first.stderr + line.stderr
    # DDP's validation loss crosses 4.7622 between its evaluations at steps 100 and 200
    assert row(first.stdout, "ddp")[4].endswith("(step 200)")
    assert row(line.stdout, "ddp")[4].endswith("(step 137)")
    assert float(row(line.stdout, "ddp")[-1].removesuffix(" s")) < float(
        row(first.stdout, "ddp")[-1].removesuffix(" s"))
