"""Elastic restarts in every layout (docs/reliability.md): a worker SIGKILLed mid-epoch under
``torchrun --max-restarts 1``, after a mid-epoch checkpoint. The group restarts, resumes from that
checkpoint and ends bitwise where an uninterrupted run ends (every tensor and number of the final
checkpoint, the sharded ones gathered whole, and the metrics but wall times), and every file the
run had written when the worker died is still there, byte for byte.

Layouts: DDP with the top-k comm hook (per-rank residuals travel through the checkpoint), FSDP2
(``--parallel fsdp``), DiLoCo (``--sync diloco``), and DiLoCo over FSDP2 (2 replicas of 2 shards).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    DILOCO_ARGS,
    SMALL,
    SWITCHED,
    TIMES,
    files_with_digests,
    free_port,
    full_state,
    metrics,
    needs_fashion,
)

from pufferfish.training import rundir
from pufferfish.training.checkpoint import latest_checkpoint
from pufferfish.training.faults import wait_stopped

# 256 examples, 32 per process and 2 processes: 4 steps per epoch; the switch is at global step 4.
ELASTIC = [*SMALL, "--train-subset", "256", "--lr", "0.05", "--epochs", "2", "--warmup-epochs",
           "1", "--checkpoint-every-steps", "2", "--comm", "topk", "--topk-ratio", "0.1"]
# Each: (flags, processes). All run 2 epochs of 4 steps with checkpoints at steps 2, 4, 6 and 8
# and switch to the low-rank model before step 4; DiLoCo's outer steps are every 2 steps.
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "ddp": (ELASTIC, 2),
    "fsdp": ([*SWITCHED, "--parallel", "fsdp"], 2),
    "diloco": (DILOCO_ARGS, 2),
}
# What a resumed run may change: the metrics, to which it appends the epochs it finishes.
APPENDED = {"metrics.jsonl", "metrics.csv"}
# The run directory's bookkeeping: the lock holds the live rank 0's pid (removed at the end), the
# outputs record forgets at the end what the run never wrote.
BOOKKEEPING = set(rundir.BOOKKEEPING)


def killed_under_torchrun(args: list[str], nproc: int, kill_step: int, run: Path,
                          ) -> tuple[subprocess.CompletedProcess, dict[str, str], str]:
    """``pufferfish train ARGS --out RUN`` under ``torchrun --max-restarts 1``, rank 1 SIGKILLed
    before ``kill_step``; and the files of RUN (with their SHA-256) and its metrics.jsonl at the
    moment it died.

    The worker first stops itself (SIGSTOP, ``pufferfish.training.faults``) so that the files are
    recorded while nothing moves, then it is killed. Every checkpoint is kept (no rotation), so
    that none of the recorded files may go."""
    marker, out, err = (run.with_name(n) for n in ("killed", "stdout.txt", "stderr.txt"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", "--master-port", str(free_port()), "-m", "pufferfish", "train",
           *args, "--keep-checkpoints", "8", "--out", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PUFFERFISH_KILL_AT_STEP": str(kill_step),
           "PUFFERFISH_KILL_RANK": "1", "PUFFERFISH_KILL_SIGNAL": "STOP",
           "PUFFERFISH_KILL_MARKER": str(marker)}
    # Files, not pipes: the workers (sessions of their own) would hold a pipe open after a failure.
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    try:
        pid = wait_stopped(marker, proc, timeout=600)
        assert pid is not None, f"the fault was not reached: {err.read_text()[-3000:]}"
        metrics_file = run / "metrics.jsonl"  # none yet in the first epoch
        rows = metrics_file.read_text() if metrics_file.exists() else ""
        before = files_with_digests(run)
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:  # failed: the workers first, then their agent
            for worker in _children(proc.pid):
                os.kill(worker, signal.SIGKILL)
            proc.kill()
            proc.wait()
    return (subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text()),
            before, rows)


def _children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def same(x: object, y: object, where: str) -> None:
    """``x`` and ``y`` equal bitwise, tensors with ``torch.equal``, nested dicts and lists."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            same(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, list | tuple):
        assert isinstance(y, list | tuple) and len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
    else:
        assert x == y, where


def final_state(run: Path) -> dict:
    """The newest checkpoint, its sharded tensors gathered whole; less its configuration (whose
    ``out`` differs) and the list of its shard files (whose metadata names them by path)."""
    found = latest_checkpoint(run)
    assert found is not None
    payload, path = found
    assert path.name == "ckpt-000000008.pt"
    state = {k: v for k, v in payload.items() if k not in ("config", "sharded")}
    if path.with_suffix(".dcp").is_dir():
        state["sharded"] = full_state(run)[1]
    return state


@needs_fashion
@pytest.mark.parametrize("layout,kill_step,resume_from", [
    # DDP before the switch: test_training.py's killed-and-resumed run at step 5 (no restart)
    ("ddp", 7, "ckpt-000000006.pt"),  # mid-epoch 1, after the switch: the factorized model
    ("fsdp", 3, "ckpt-000000002.pt"),  # the full-rank sharded model
    ("fsdp", 7, "ckpt-000000006.pt"),  # the factorized sharded model
    ("diloco", 7, "ckpt-000000006.pt"),  # one inner step after the outer step of step 6
    # DiLoCo over FSDP2: test_diloco_fsdp.py's exact resume from a mid-run outer step (the
    # restart itself is torchrun's, the same for every layout)
])
def test_a_killed_worker_resumes_exactly_and_keeps_every_file(
        uninterrupted: Callable[..., Path], tmp_path: Path, layout: str, kill_step: int,
        resume_from: str) -> None:
    args, nproc = LAYOUTS[layout]
    reference, run = uninterrupted(args, nproc), tmp_path / "run"
    result, before, rows = killed_under_torchrun(args, nproc, kill_step, run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / resume_from}" in result.stdout
    after = files_with_digests(run)
    changed = [name for name, digest in before.items()
               if after.get(name) != digest and name not in APPENDED | BOOKKEEPING]
    assert not changed, changed  # checkpoints, shards, manifests, configuration, the switch's
    assert (run / "metrics.jsonl").read_text().startswith(rows)  # the rows before the kill too
    same(final_state(reference), final_state(run), layout)
    for x, y in zip(metrics(reference), metrics(run), strict=True):
        drop = TIMES | {"peak_rss_bytes"}
        assert {k: v for k, v in x.items() if k not in drop} == \
            {k: v for k, v in y.items() if k not in drop}
