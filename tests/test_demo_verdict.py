"""`make demo`'s verdict over its cached runs: every method's line and who reached the target first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHED = ROOT / "benchmarks" / "results" / "demo-2026-12-05"


def test_the_verdict_names_who_reached_ddps_final_minus_half_a_point_first() -> None:
    result = subprocess.run([sys.executable, "benchmarks/demo_verdict.py", str(CACHED),
                             "ddp,pufferfish,powersgd"], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("ddp") and lines[2].startswith("pufferfish")
    assert "-0.10 points, 1.32x the speed" in lines[2]  # a method without runs is left out
    assert "to 89.32% (ddp's final - 0.5): ddp 327 s, pufferfish 248 s; first: pufferfish" \
        in result.stdout
