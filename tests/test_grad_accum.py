"""``--grad-accum N``: N micro-batches per optimizer step, one gradient synchronization each."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    cli_stderr,
    free_port,
    killed_and_resumed,
    llama_args,
    metrics,
    needs_fashion,
    report_to_parent,
    run_cli,
    run_worker_pair,
    tiny_lm_args,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from pufferfish.cli import main
from pufferfish.config import ConfigError
from pufferfish.configfile import load_config
from pufferfish.distributed.hooks import register_comm_hook
from pufferfish.training.checkpoint import latest_checkpoint
from pufferfish.training.step import Replica, micro_batch_groups, train_step

# -- the step itself: every synchronization, in a 2-process gloo group ---------------------------

STEPS, B = 4, 4  # optimizer steps; micro-batch per process


def _replica(sync: str) -> tuple[Replica, Any]:
    """A tiny MLP (no BatchNorm, no dropout: accumulation is then exact), wrapped as ``sync``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    state = None
    if sync == "fsdp":
        wrapped = fully_shard(model)
    elif sync == "local":  # DiLoCo's inner steps: no wrapper, nothing synchronized per step
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
        options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2} \
            if sync == "powersgd" else {}
        state = register_comm_hook(wrapped, sync, **options)
    return Replica(model, wrapped, torch.optim.SGD(model.parameters(), lr=0.5)), state


def _train(sync: str, accum: int, rank: int) -> dict[str, Any]:
    """STEPS steps on 2B examples per process, as ``accum`` micro-batches; the final weights
    (unsharded) and the comm hook's counts."""
    replica, state = _replica(sync)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(2 * B, 16, generator=g), torch.randint(0, 8, (2 * B,), generator=g)

        def loss(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(replica.wrapped(xs), ys)

        parts = [functools.partial(loss, xs, ys)
                 for xs, ys in zip(x.chunk(accum), y.chunk(accum))]
        train_step(replica, parts if accum > 1 else parts[0])
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist()
               for k, v in replica.model.state_dict().items()}  # plain data through the queue
    stats = state.stats.snapshot() if state is not None else {}
    return {"weights": weights, "calls": stats.get("comm_calls"), "bytes": stats.get("bytes_sent")}


def _step_worker(rank: int, port: int, queue: Any) -> None:
    def work() -> dict[str, Any]:
        return {sync: (_train(sync, 2, rank), _train(sync, 1, rank))
                for sync in ("allreduce", "powersgd", "fsdp", "local")}
    report_to_parent(rank, port, queue, work)


def test_two_micro_batches_equal_one_batch_twice_as_large_under_every_sync() -> None:
    results = run_worker_pair(_step_worker)
    for sync, (accumulated, plain) in results[0].items():
        for key, want in plain["weights"].items():
            got = accumulated["weights"][key]
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6), \
                (sync, key)
        # the hook ran once per optimizer step (PowerSGD's error feedback included): the same
        # calls and bytes as the step of one big batch
        assert accumulated["calls"] == plain["calls"] and accumulated["bytes"] == plain["bytes"]
    for sync in ("allreduce", "powersgd", "fsdp"):  # synchronized: the replicas agree
        for key, w in results[0][sync][0]["weights"].items():
            other = results[1][sync][0]["weights"][key]
            assert torch.allclose(torch.tensor(w), torch.tensor(other), atol=1e-6), (sync, key)


def test_an_incomplete_last_group_is_dropped() -> None:
    assert list(micro_batch_groups(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(micro_batch_groups(range(2), 3)) == []


# -- pufferfish train: 2 processes (gloo), llama without dropout ---------------------------------

def _llama(tmp_path: Path, out: str, *extra: str) -> Path:
    run_dir = tmp_path / out
    args = llama_args(tmp_path, "--mode", "full", "--epochs", "1", "--train-subset", "1200",
                      "--optimizer", "sgd", "--momentum", "0", "--grad-clip", "0",
                      "--bucket-mb", "torch", *extra)  # extra's --batch-size wins
    result = run_cli("train", *args, "--out", str(run_dir), torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_train_accumulates_like_a_twice_larger_batch_with_a_nth_of_the_bytes(tmp_path: Path) -> None:
    accumulated = _llama(tmp_path, "accum", "--batch-size", "2", "--grad-accum", "2")
    big = _llama(tmp_path, "big", "--batch-size", "4")
    plain = _llama(tmp_path, "plain", "--batch-size", "2")
    sharded = _llama(tmp_path, "fsdp", "--batch-size", "2", "--grad-accum", "2",
                     "--parallel", "fsdp")
    (a,), (b,), (p,), (s,) = metrics(accumulated), metrics(big), metrics(plain), metrics(sharded)
    assert a["steps"] == b["steps"] == p["steps"] // 2 > 1  # optimizer steps
    weights_a, weights_b = (latest_checkpoint(d)[0]["model"] for d in (accumulated, big))
    for key, want in weights_b.items():
        assert torch.allclose(weights_a[key], want, rtol=1e-4, atol=1e-6), key
    for row in (a, s):
        assert row["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert row["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    # one all-reduce per optimizer step: DDP's bytes per step as plain DDP's, per sample half
    assert a["comm_bytes_per_step"] == p["comm_bytes_per_step"] == b["comm_bytes_per_step"]
    assert a["comm_bytes_per_sample"] == pytest.approx(p["comm_bytes_per_sample"] / 2)
    # FSDP2: all-gathers in each micro-batch, one reduce-scatter per optimizer step
    assert s["comm_bytes_per_step"] == pytest.approx(
        s["all_gather_bytes_per_step"] + s["reduce_scatter_bytes_per_step"])
    assert s["all_gather_bytes_per_step"] > s["reduce_scatter_bytes_per_step"]


# -- resume and bad values (one process, the tiny LSTM) ------------------------------------------

def test_resume_keeps_grad_accum_or_refuses_a_change(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The LSTM's kernel fixed: timed at the switch, the two runs can pick different ones on a
    # loaded machine, and the kernels round differently (measured: fused in one, loop in the other).
    args = tiny_lm_args(tmp_path, "--epochs", "2", "--warmup-epochs", "1", "--grad-accum", "2",
                        "--checkpoint-every-steps", "4", "--dropout", "0", "--kernel", "loop")
    ref, run = killed_and_resumed(args, tmp_path, kill_step=9)  # mid-epoch, optimizer steps
    a, b = (latest_checkpoint(d)[0]["model"] for d in (ref, run))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["steps"] for r in metrics(run)] == [29, 29]  # 59 micro-batches: the last dropped
    code, lines = cli_stderr(["train", "--resume", str(run), "--grad-accum", "3", "--epochs",
                              "3", "--no-progress"], capfd)  # in this process
    assert code == 2, lines
    assert len(lines) == 1 and "--grad-accum: checkpoint has 2, this run has 3" in lines[0]


@pytest.mark.parametrize("value,message", [
    ("0", "--grad-accum 0 is invalid: allowed an integer >= 1"),
    ("1000", "--grad-accum 1000 is invalid with 59 micro-batch(es)"),  # more than an epoch has
])
def test_bad_grad_accum_is_refused_in_one_line(tmp_path: Path, value: str, message: str,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    # in this process (a real one's exit: tests/test_reliability.py's one-line checks)
    code, lines = cli_stderr(["train", *tiny_lm_args(tmp_path, "--grad-accum", value),
                              "--out", str(tmp_path / "run")], capfd)
    assert code == 2, lines
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_negative_grad_accum_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"grad_accum -2 is invalid: allowed an integer >= 1"):
        load_config(None, {"grad_accum": "-2"})


# -- pufferfish bench: a step of N micro-batches, one synchronization ----------------------------

def _bench_steps(tmp_path: Path, accum: int) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"steps{accum}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "pufferfish.bench.step",
           "--methods", "ddp,powersgd,fsdp", "--model", "resnet18", "--width", "0.125",
           "--batch-size", "4", "--grad-accum", str(accum), "--steps", "2", "--warmup", "2",
           "--compute-steps", "1", "--threads", "1", "--bucket-mb", "torch", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return {r["method"]: r for r in json.loads(out.read_text())}


@needs_fashion
def test_bench_step_accumulates_with_one_synchronization(tmp_path: Path) -> None:
    one, two = _bench_steps(tmp_path, 1), _bench_steps(tmp_path, 2)
    for method in ("ddp", "powersgd"):  # the hook runs once per optimizer step
        assert two[method]["grad_accum"] == 2 and one[method]["grad_accum"] == 1
        for key in ("bytes_per_step", "collectives_per_step"):
            assert two[method][key] == one[method][key], (method, key)
    # FSDP2 gathers the weights in every micro-batch and reduce-scatters once
    assert two["fsdp"]["reduce_scatter_bytes_per_step"] == one["fsdp"]["reduce_scatter_bytes_per_step"]
    assert two["fsdp"]["all_gather_bytes_per_step"] == 2 * one["fsdp"]["all_gather_bytes_per_step"]


def test_bench_refuses_a_bad_grad_accum_in_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for args, needle in ((["--grad-accum", "0"], "--grad-accum 0 is invalid: allowed an integer >= 1"),
                         (["--grad-accum", "2", "--train"], "--grad-accum 2 is invalid with --train")):
        assert main(["bench", *args, "--out", str(tmp_path / "bench")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "bench").exists()
