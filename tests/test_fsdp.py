"""Sharded data parallel (FSDP2) with real 2-process gloo groups: the switch, checkpoints, resume.

Pufferfish under FSDP2 follows DDP's losses through the switch (the same gradients, reduced in
another order: float32 rounding only, tolerance 1e-5 relative); a killed worker's run resumes
bitwise exactly from the sharded checkpoint before and after the switch; a checkpoint written by
2 processes loads exactly on 1 and back; a corrupt shard is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    FSDP_SMALL,
    SWITCHED,
    cli,
    full_state,
    metrics,
    needs_fashion,
    run_cli,
    torchrun,
)

from pufferfish.distributed.fsdp import fsdp_units
from pufferfish.models import build_at_width
from pufferfish.training import checkpoint as ck

WORKER = Path(__file__).with_name("fsdp_worker.py")


def test_units_are_the_blocks_of_any_container() -> None:
    resnet = build_at_width("resnet18", 0.125)
    assert fsdp_units(resnet) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    lm = build_at_width("transformer", 0.125, vocab_size=50)
    assert fsdp_units(lm) == [f"encoder.layers.{i}" for i in range(4)]
    assert fsdp_units(build_at_width("lstm", 0.01, vocab_size=50)) == []  # the root alone


@pytest.mark.parametrize("argv,message", [
    (["--parallel", "fsdp", "--comm", "powersgd"], "comm 'powersgd' is invalid with --parallel "
                                                   "'fsdp'"),
    (["--parallel", "fsdp"], "parallel 'fsdp' is invalid without a process group"),
    (["--parallel", "zero"], "parallel 'zero' is invalid: allowed ddp, fsdp"),
    (["--parallel", "fsdp", "--rank-ratio", "auto"], "--rank-ratio 'auto' is invalid with --parallel"),
])
def test_refusals_are_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["train", *FSDP_SMALL, "--epochs", "3", "--out", str(tmp_path / "r"), *argv],
                       capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def runs(uninterrupted: Callable[..., Path]) -> dict[str, Path]:
    """The same Pufferfish run under DDP and under FSDP2, 2 processes each (the FSDP2 one is also
    the reference of test_elastic.py's killed run)."""
    return {parallel: uninterrupted([*SWITCHED, "--parallel", parallel])
            for parallel in ("ddp", "fsdp")}


@needs_fashion
def test_fsdp_follows_ddp_through_the_switch(runs: dict[str, Path]) -> None:
    ddp, sharded = metrics(runs["ddp"]), metrics(runs["fsdp"])
    assert [r["lowrank"] for r in sharded] == [False, True]
    for a, b in zip(ddp, sharded, strict=True):
        for key in ("train_loss", "test_loss", "test_acc"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert a["params"] == b["params"] and a["macs"] == b["macs"]
    # Pufferfish shrinks what FSDP2 moves and keeps: bytes per step and the shards, ~3.3x
    before, after = sharded
    assert after["comm_bytes_per_step"] < before["comm_bytes_per_step"] / 3
    assert after["shard_param_bytes"] < before["shard_param_bytes"] / 3
    assert before["shard_param_bytes"] == pytest.approx(4 * before["params"] / 2, rel=0.01)
    assert (runs["fsdp"] / "checkpoints" / "ckpt-000000008.dcp").is_dir()


@needs_fashion
def test_a_corrupt_shard_is_refused_and_set_aside(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["fsdp"], run)  # then a flipped byte in a shard of the newest checkpoint
    shard = run / "checkpoints" / "ckpt-000000008.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"__1_0.distcp fails its SHA-256 check"):
        ck.load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt")
    result = run_cli("train", *SWITCHED, "--parallel", "fsdp", "--epochs", "2", "--out",
                     str(run), "--resume", str(run), torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'ckpt-000000006.pt'}" in result.stdout
    assert (run / "checkpoints" / "rejected" / "ckpt-000000008.dcp" / "__1_0.distcp").exists()
    (_, a), (_, b) = full_state(runs["fsdp"]), full_state(run)
    for key, t in a["model"].items():
        assert torch.equal(t, b["model"][key]), key


def test_a_checkpoint_of_2_processes_loads_on_1_and_back(tmp_path: Path) -> None:
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    for nproc, args in ((2, ["save", str(two)]), (1, ["load", str(two), str(one)]),
                        (2, ["load", str(one)])):
        result = torchrun(nproc, str(WORKER), *args)
        assert result.returncode == 0, result.stderr[-3000:]
    for path in (two / "load-1.json", one / "load-2.json"):
        loaded = json.loads(path.read_text())
        assert loaded["diffs"] == [] and loaded["n"] > 100 and loaded["momenta"] > 50, loaded


def test_recipe_switches_a_users_fully_shard_model_like_data_parallel(tmp_path: Path) -> None:
    out = tmp_path / "recipe.json"
    result = torchrun(2, str(WORKER), "recipe", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())
    sharded, reference = runs["fsdp"], runs["reference"]
    assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert sharded["same_params"] and sharded["all_sharded"]
    # the optimizer edited in place as without sharding: the same removals, additions, states
    for key in ("kept_with_state", "removed", "added", "lr"):
        assert sharded[key] == reference[key], key
    assert reference["kept_with_state"] == 0  # reset: every state empty, as the CLI's optimizer


def test_lightning_callback_switches_a_fully_shard_model_like_ddp(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy (gloo on CPU): each layer a unit of its own."""
    got = {}
    for strategy in ("ddp", "fsdp"):
        result = torchrun(2, str(WORKER), "lightning", str(tmp_path / strategy), strategy)
        assert result.returncode == 0, result.stderr[-3000:]
        got[strategy] = json.loads((tmp_path / strategy).read_text())
    assert got["fsdp"]["sharded"] and not got["ddp"]["sharded"]
    assert got["fsdp"]["switched_at"] == got["ddp"]["switched_at"] == 1
    assert got["fsdp"]["params_after"] == got["ddp"]["params_after"] == 5_384
    assert got["fsdp"]["losses"] == pytest.approx(got["ddp"]["losses"], rel=1e-5)


def test_bytes_per_step_are_what_fsdp_hands_to_its_collectives(tmp_path: Path) -> None:
    """comm_bytes' formula against the bytes counted at torch.distributed, before and after the
    switch: all-gathers (forward, and backward for every unit but the root) and reduce-scatters,
    and how many of them one step launches; and a step of 2 micro-batches (gradient accumulation,
    one reduce-scatter)."""
    out = tmp_path / "count.json"
    result = torchrun(2, str(WORKER), "count", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    before, after, accumulated = json.loads(out.read_text())
    for row in (before, after, accumulated):
        assert row["counted"]["all_gather"] == row["all_gather"]
        assert row["counted"]["reduce_scatter"] == row["reduce_scatter"]
        assert row["counted"]["calls"] == row["collectives"]
    assert after["all_gather"] < before["all_gather"] / 3
    assert accumulated["all_gather"] == 2 * after["all_gather"]
    assert accumulated["reduce_scatter"] == after["reduce_scatter"]


def test_amp_s_parameter_dtype_is_its_autocast_s_except_beside_batchnorm() -> None:
    """--amp under FSDP2: parameters in the autocast's dtype (bf16 on the CPU, fp16 on CUDA), fp32
    reduction; a model with BatchNorm keeps fp32 parameters (batch_norm refuses fp32 statistics
    beside bf16 weights: `train --parallel fsdp --amp` on ResNet-18 failed so); none without it."""
    from pufferfish.distributed.fsdp import mixed_precision

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    llama = build_at_width("llama", 0.125, vocab_size=64)
    resnet = build_at_width("resnet18", 0.25)
    assert mixed_precision(cpu, True, llama).param_dtype == torch.bfloat16
    assert mixed_precision(gpu, True, llama).param_dtype == torch.float16
    assert mixed_precision(cpu, True, llama).reduce_dtype == torch.float32
    assert mixed_precision(gpu, True, resnet).param_dtype is None
    assert mixed_precision(gpu, False, llama).param_dtype is None
