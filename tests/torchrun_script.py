"""Run one of the test scripts under ``torchrun --nproc-per-node 2`` and read what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(script: str, out: Path, timeout: float = 300) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node 2 tests/<script> <out>``; each rank's ``out/rank{R}.json``.

    The worktree's ``pufferfish`` comes first on the path; one thread per process (2 cores).
    A run that hangs is killed, workers included, and fails the test.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # --standalone: torchrun picks a free port itself (no window for another process to take it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / script), str(out)]
    # its own process group: on a timeout the workers go too, not only the torchrun agent
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {script} hung for {timeout} s:\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, f"rc {proc.returncode}\n{stderr[-4000:]}\n{stdout[-1000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
