"""DiLoCo over FSDP2 (``--parallel fsdp --sync diloco``): 4 real gloo processes as 2 replicas of
2 shards. The outer step equals plain DiLoCo's Nesterov step on the replicas' full weights
(float32 rounding: 1e-5 absolute); replicas differ between outer steps and hold the same full
weights after each; an outer step ships this process's shard of the pseudo-gradients; a run
through the switch written by two "machines" (two torchrun agents, ``--nnodes 2``) resumes
bitwise exactly from a mid-run sharded checkpoint on one agent with ``--shard-size 2`` (and is
refused on another number of replicas); a single replica, a world that is not a multiple of the
shard size and machines of different sizes are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FSDP_SMALL, TIMES, cli, free_port, full_state, metrics, needs_fashion, torchrun

from pufferfish.distributed.replicas import grid

WORKER = Path(__file__).with_name("diloco_fsdp_worker.py")
# 256 examples, 16 per process, 4 processes: 4 steps per epoch; outer steps every 2 steps; the
# switch before epoch 1 (global step 4) is on an outer-step boundary; checkpoints at 2, 4, 6, 8.
ARGS = [*FSDP_SMALL, "--batch-size", "16", "--train-subset", "256", "--lr", "0.05", "--epochs", "2",
        "--warmup-epochs", "1", "--preset", "paper", "--parallel", "fsdp", "--sync", "diloco",
        "--inner-steps", "2", "--checkpoint-every-steps", "2"]


def two_machines(*args: str, nproc: tuple[int, int] = (2, 2)) -> list[subprocess.CompletedProcess]:
    """``pufferfish train ARGS`` as two torchrun agents (``nproc`` processes each) on 127.0.0.1."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "pufferfish", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for node, n in enumerate(nproc)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def test_the_outer_step_is_plain_diloco_on_the_replicas_full_weights(tmp_path: Path) -> None:
    out = tmp_path / "found.json"
    result = torchrun(4, str(WORKER), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["differ_before"] == [True] * 3  # each replica trained on its own batches
    assert found["equal_after"] == [True] * 3  # the same full weights on every process
    assert max(found["max_error"]) < 1e-5  # against an unsharded Nesterov SGD on the mean
    assert found["buffers_equal"] == [True] * 3  # BatchNorm statistics: every process's mean
    # rank 0's shard of the 504 parameter bytes (276: dim 0 split in 2, rounded up) + 80 of
    # BatchNorm statistics
    assert found["bytes_per_outer_step"] == [276 + 80] * 3
    assert found["full_param_bytes"] == 504


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("diloco_fsdp") / "run"
    for result in two_machines(*ARGS, "--out", str(out)):
        assert result.returncode == 0, result.stderr[-3000:]
    return out


@needs_fashion
def test_two_machines_train_through_the_switch(run: Path) -> None:
    rows = metrics(run)
    assert [r["lowrank"] for r in rows] == [False, True] and [r["outer_steps"] for r in rows] \
        == [2, 4]
    for r in rows:  # every byte of a step: FSDP2's inside a replica, DiLoCo's across replicas
        assert r["comm_bytes_per_step"] == pytest.approx(
            r["all_gather_bytes_per_step"] + r["reduce_scatter_bytes_per_step"]
            + r["outer_bytes_per_step"])
        assert r["outer_bytes_per_step"] == r["comm_bytes_per_outer_step"] / 2
        # this process's shard of the pseudo-gradients (+ BatchNorm statistics): about half
        assert 0.45 * 4 * r["params"] < r["comm_bytes_per_outer_step"] < 0.6 * 4 * r["params"]
    payload, full = full_state(run)
    assert payload["replicas"] == 2 and full["sync"]["synced"].keys() == {
        k for k in full["model"] if "running" not in k and "num_batches" not in k}
    inner = [full["optimizer"][f"replica{i}"]["state"] for i in (0, 1)]
    assert inner[0].keys() == inner[1].keys()  # each replica's own inner momentum, kept apart
    assert any(not torch.equal(inner[0][k]["momentum_buffer"], inner[1][k]["momentum_buffer"])
               for k in inner[0])


@needs_fashion
def test_resume_from_a_mid_run_outer_step_is_exact(run: Path, tmp_path: Path) -> None:
    """From step 6 (after the switch, mid-epoch), on one agent of 4 processes, --shard-size 2:
    the same grid, so the same final checkpoint, bit for bit."""
    again = tmp_path / "run"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("ckpt-000000008.*"))
    result = torchrun(4, "-m", "pufferfish", "train", "--resume", str(again), "--shard-size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {again / 'checkpoints' / 'ckpt-000000006.pt'}" in result.stdout
    (pa, a), (pb, b) = full_state(run), full_state(again)
    assert pa["progress"] == pb["progress"] and pa["sync"] == pb["sync"]

    def same(x: object, y: object, where: str) -> None:
        if isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), where
            for k in x:
                same(x[k], y[k], f"{where}/{k}")
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), where
        else:
            assert x == y, where

    same(a, b, "")  # model, each replica's inner optimizer, synchronized weights, outer momentum
    for x, y in zip(metrics(run), metrics(again), strict=True):
        assert {k: v for k, v in x.items() if k not in TIMES | {"peak_rss_bytes"}} == \
            {k: v for k, v in y.items() if k not in TIMES | {"peak_rss_bytes"}}


@needs_fashion
def test_resume_on_another_number_of_replicas_is_refused(run: Path, tmp_path: Path) -> None:
    """Each replica's inner optimizer is its own: 4 replicas of 1 cannot continue 2 of 2."""
    again = tmp_path / "run"
    shutil.copytree(run, again)
    result = torchrun(4, "-m", "pufferfish", "train", "--resume", str(again), "--shard-size", "1")
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    assert "was written by 2 DiLoCo replica(s) over FSDP2, this run has 4: resume it with the " \
           "same number of processes and --shard-size" in result.stderr


@needs_fashion
def test_a_single_replica_is_refused_in_one_line(tmp_path: Path) -> None:
    result = torchrun(2, "-m", "pufferfish", "train", *ARGS, "--out", str(tmp_path / "r"))
    lines = [line for line in result.stderr.splitlines() if "invalid" in line]
    assert result.returncode != 0 and lines, result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr  # each process's exit status, under torchrun's
    assert "shard_size 0 (LOCAL_WORLD_SIZE 2, the processes of one machine) is invalid with " \
           "--sync 'diloco' on 2 processes (one replica: nothing for DiLoCo to average)" in lines[0]


@needs_fashion
def test_machines_of_different_sizes_are_refused_in_one_line(tmp_path: Path) -> None:
    """2 processes on one machine, 1 on the other: no grid of replicas x shards."""
    results = two_machines(*ARGS, "--out", str(tmp_path / "r"), nproc=(2, 1))
    for result in results:
        assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
        assert "shard_size 0 is invalid when machines run different numbers of processes " \
               "(LOCAL_WORLD_SIZE 1 to 2)" in result.stderr


def test_the_grid_and_its_refusals() -> None:
    assert grid(4, 2) == (2, 2) and grid(8, 4) == (2, 4) and grid(6, 1) == (6, 1)
    with pytest.raises(ValueError, match=r"^shard_size 3 is invalid with 4 processes: allowed a "
                                         r"divisor of the world size$"):
        grid(4, 3)
    with pytest.raises(ValueError, match=r"^shard_size 4 is invalid with sync 'diloco' on 4 "):
        grid(4, 4)


@pytest.mark.parametrize("argv,message", [
    (["--shard-size", "2"], "--shard-size 2 is invalid without parallel 'fsdp' and sync 'diloco'"),
    (["--shard-size", "-1"], "--shard-size -1 is invalid: allowed an integer >= 0"),
    (["--parallel", "fsdp", "--sync", "diloco", "--outer-switch-momentum", "project"],
     "--outer-switch-momentum 'project' is invalid with --parallel 'fsdp'"),
])
def test_bad_settings_are_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["train", *FSDP_SMALL, "--out", str(tmp_path / "r"), *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
