"""DDP's gradient buckets (``--bucket-mb``, ``Recipe(bucket_mb=)``): applied, timed, rebuilt.

Bucket counts are read where they happen: the comm hook is called once per bucket and step
(``CommStats.comm_calls``), in a real 2-process gloo group.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import SMALL, cli_stderr, needs_fashion, report_to_parent, run_cli, run_worker_pair
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pufferfish as pf
from pufferfish.distributed.buckets import MIB, BucketTuner, parse_bucket_mb
from pufferfish.distributed.env import DistEnv, wrap_ddp
from pufferfish.distributed.hooks import register_comm_hook

CAP = 0.02  # MiB: a few of the MLP's 64x64 layers per bucket


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])


def _step(ddp: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 10 * dist.get_rank())
    ddp.zero_grad()
    ddp(torch.randn(8, 64, generator=g)).square().mean().backward()
    with torch.no_grad():
        for p in ddp.parameters():
            p -= 0.01 * p.grad


def _buckets(ddp: DDP, state: Any, seed: int = 0) -> int:
    """Buckets reduced in a step (after DDP's first step, which re-buckets)."""
    _step(ddp, seed)
    state.stats.reset()
    _step(ddp, seed + 1)
    return int(state.stats.snapshot()["comm_calls"])


def _fixed(env: DistEnv) -> dict[str, Any]:
    counts = {}
    for cap in (None, CAP):
        ddp = wrap_ddp(_mlp(), env, cap)
        counts[str(cap)] = _buckets(ddp, register_comm_hook(ddp, "allreduce"))
    return counts


def _tuner() -> dict[str, Any]:
    model = _mlp()
    ddp = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    state = register_comm_hook(ddp, "allreduce")
    replica = SimpleNamespace(wrapped=ddp)
    tuner = BucketTuner("auto", fractions=(4,), rounds=1, timed_steps=1, threshold=-1.0)
    first = tuner.start(model, "start", steps_per_epoch=1000)
    steps = 0
    while tuner.trying:
        with tuner.step(replica):
            _step(replica.wrapped, steps)
        steps += 1
    new = replica.wrapped
    decision = tuner.decisions[-1]
    cap = decision["cap_mib"]
    return {"first": first, "steps": steps, "decision": decision,
            "applied": new.bucket_bytes_cap == (int(cap * MIB) if cap else 25 * MIB),
            "hook_kept": new._comm_hooks[0][1] is state,
            "options_kept": new.gradient_as_bucket_view and not new.broadcast_buffers,
            "buckets": _buckets(new, state, 100),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def _recipe() -> dict[str, Any]:
    model = _mlp()
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True)
    state = register_comm_hook(ddp, "allreduce")
    before = _buckets(ddp, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio=0.25, bucket_mb=CAP / 4)
    new, _, _ = recipe.switch(1, ddp, opt)
    return {"before": before, "after": _buckets(new, state),
            "cap": new.bucket_bytes_cap == int(CAP / 4 * MIB),
            "options_kept": new.find_unused_parameters and new.gradient_as_bucket_view,
            "hook_kept": new._comm_hooks[0][1] is state}


def _worker(rank: int, port: int, queue: Any) -> None:
    def work() -> dict[str, Any]:
        env = DistEnv(rank=rank, world_size=2, backend="gloo")
        return {"fixed": _fixed(env), "tuner": _tuner(), "recipe": _recipe()}

    report_to_parent(rank, port, queue, work)


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return run_worker_pair(_worker)


def test_a_fixed_cap_is_applied(results: dict[int, Any]) -> None:
    for rank in (0, 1):
        counts = results[rank]["fixed"]
        assert counts["None"] == 1  # torch's default: the whole 0.1 MiB model in one bucket
        assert counts[str(CAP)] >= 3


def test_the_trial_times_every_candidate_and_applies_one_choice_on_every_rank(
        results: dict[int, Any]) -> None:
    r0, r1 = results[0]["tuner"], results[1]["tuner"]
    assert r0["decision"] == r1["decision"]  # rank 0 decided, every rank applied it
    assert r0["first"] is None and r0["steps"] == 4  # torch's default first; 2 visits x 2 steps
    assert set(r0["decision"]["timed_steps"].values()) == {1}
    assert len(r0["decision"]["median_ms"]) == 2
    for r in (r0, r1):
        assert r["applied"] and r["hook_kept"] and r["options_kept"]
        assert (r["buckets"] == 1) == (r["decision"]["cap_mib"] is None)
    assert r0["weights"] == r1["weights"]  # re-wrapped without init_sync, replicas still equal


def test_recipe_rebuilds_with_its_buckets_keeping_options_and_hook(
        results: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = results[rank]["recipe"]
        assert r["cap"] and r["options_kept"] and r["hook_kept"]
        assert r["after"] > r["before"] == 1


@pytest.mark.parametrize("value", ["0", "-1", "big", "nan", True])
def test_bad_bucket_mb_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"bucket_mb .* is invalid: allowed 'auto', 'torch'"):
        parse_bucket_mb(value)
    with pytest.raises(ValueError, match=r"bucket_mb .* is invalid: allowed None, 'torch'"):
        pf.Recipe(bucket_mb=value)


def test_recipe_bucket_mb_values() -> None:
    assert pf.Recipe(bucket_mb=0.5).bucket_mb == 0.5
    assert pf.Recipe(bucket_mb="torch").bucket_mb == "torch"
    with pytest.raises(ValueError, match="'auto' times real steps"):
        pf.Recipe(bucket_mb="auto")


def test_cli_refuses_a_bad_bucket_mb_in_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    code, lines = cli_stderr(["train", "--bucket-mb", "0"], capfd)  # in this process
    assert code == 2
    assert lines == [
        "pufferfish: error: --bucket-mb '0' is invalid: allowed 'auto', 'torch' or a bucket cap in "
        "MiB > 0 (e.g. 0.25)"]


@needs_fashion
def test_train_records_the_buckets_of_each_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *SMALL, "--train-subset", "128", "--epochs", "2",
                     "--warmup-epochs", "1", "--bucket-mb", "0.05", "--out", str(out),
                     torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "factorization.json").read_text())
    phases = [(d["phase"], d["cap_mib"]) for d in report["buckets"]]
    assert phases == [("start", 0.05), ("after the factorization at epoch 1", 0.05)]
    assert report["buckets"][1]["gradient_mib"] < report["buckets"][0]["gradient_mib"]
    assert "gradient buckets (start" in (out / "factorization.txt").read_text()
    assert json.loads((out / "buckets.json").read_text()) == report["buckets"]
