"""The training recipe end to end: real processes, real gloo groups, real Fashion-MNIST files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    TINY,
    cli_stderr,
    free_port,
    killed_and_resumed,
    metrics,
    needs_fashion,
    run_cli,
    write_idx,
)
from torch import nn

import pufferfish as pf
from pufferfish.configfile import load_config
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.training.checkpoint import latest_checkpoint


@needs_fashion
def test_two_process_run_through_the_switch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *TINY, "--epochs", "2", "--warmup-epochs", "1", "--out", str(out),
                     torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["lowrank"] for r in rows] == [False, True]
    assert rows[1]["params"] < rows[0]["params"] / 2.5
    # DDP ships one fp32 gradient per parameter: bytes/step fall with the parameter count.
    assert rows[0]["comm_bytes_per_step"] == pytest.approx(4 * rows[0]["params"], rel=0.01)
    assert rows[1]["comm_bytes_per_step"] == pytest.approx(4 * rows[1]["params"], rel=0.01)
    for key in ("epoch", "train_loss", "test_acc", "params", "macs", "epoch_time",
                "comm_bytes_per_step"):
        assert key in rows[0]
    for row in rows:  # both splits every epoch, each sharded over the two ranks
        assert 0 <= row["val_acc"] <= 1 and 0 <= row["test_acc"] <= 1
        assert row["val_loss"] > 0 and row["test_loss"] > 0
        assert (64 * row["val_acc"]).is_integer() and (64 * row["test_acc"]).is_integer()
    assert "| val_acc " in result.stdout
    assert (out / "factorization.txt").exists() and (out / "metrics.csv").exists()
    assert "switching to the low-rank model at epoch 1" in result.stdout
    assert result.stdout.count("epoch 1/2 |") == 1  # only rank 0 prints
    # Trained channels-last (the default), the factors made at the switch too (saved strides).
    state, _ = latest_checkpoint(out)
    convs = [t for t in state["model"].values() if t.dim() == 4 and t.size(1) > 1
             and t.size(-1) > 1]  # a 1x1 or single-channel kernel is both layouts
    assert convs and not any(t.is_contiguous() for t in convs)
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in convs)


@needs_fashion
@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_full_and_lowrank_modes(tmp_path: Path, mode: str) -> None:
    out = tmp_path / mode
    result = run_cli("train", *TINY, "--epochs", "1", "--mode", mode, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = metrics(out)
    assert row["lowrank"] is (mode == "lowrank")  # lowrank: factorized before the first step
    assert row.get("switch_epoch") == (0 if mode == "lowrank" else None)


@needs_fashion
def test_checkpoint_every_epochs_zero_keeps_only_the_final_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *TINY, "--epochs", "2", "--mode", "full", "--out", str(out),
                     "--checkpoint-every-epochs", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["epoch"] for row in metrics(out)] == [1, 2]
    state, path = latest_checkpoint(out)
    assert state["progress"]["epoch"] == 2, path
    assert len(list(path.parent.glob("*.pt"))) == 1  # nothing after epoch 1


def _switch_worker(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)  # different initial weights: DDP must make them agree
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 36, 64),
                          nn.ReLU(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio=0.25)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    gathered = []
    for epoch in range(3):
        ddp, opt, _ = recipe.on_epoch_start(epoch, ddp, opt)
        x_r = x + rank  # different data per rank
        loss = nn.functional.cross_entropy(ddp(x_r), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
        both = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(both, flat)
        gathered.append((both[0] - both[1]).abs().max().item())
    kinds = [type(m).__name__ for m in ddp.module]
    if rank == 0:
        queue.put((gathered, kinds, opt.state_dict()["state"] != {}))
    queue.close()
    queue.join_thread()  # the result is sent before os._exit
    cleanup()
    exit_process(0)  # no interpreter shutdown after a group (pufferfish.distributed.env)


def test_replicas_identical_after_the_switch() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_switch_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    gathered, kinds, has_state = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert kinds == ["LowRankConv2d", "ReLU", "Flatten", "LowRankLinear", "ReLU", "LowRankLinear"]
    assert gathered == [0.0, 0.0, 0.0], gathered  # bitwise identical before and after the switch
    assert has_state  # the optimizer, edited in place, is in use


def test_switch_keeps_the_optimizer_and_resets_replaced_momentum() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.01  # as a schedule would have left it
    recipe = pf.Recipe(warmup_epochs=0, rank_ratio=0.25)
    model, same, _ = recipe.on_epoch_start(0, model, opt)
    assert same is opt and opt.state_dict()["state"] == {}  # every layer replaced: no momentum
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 5e-4
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(run_dir)
    assert found is not None
    return found[0]["model"]


@needs_fashion
# Killed before the switch (epoch 0); after it, test_elastic.py's DDP case (2 processes under
# torchrun, a comm hook, killed after the switch) checks the same bitwise.
@pytest.mark.parametrize("kill_step", [5])
def test_resume_gives_the_same_final_parameters(tmp_path: Path, kill_step: int) -> None:
    args = [*TINY, "--epochs", "3", "--warmup-epochs", "1", "--checkpoint-every-steps", "3"]
    ref, run = killed_and_resumed(args, tmp_path, kill_step)
    a, b = _final_params(ref), _final_params(run)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ra, rb = metrics(ref), metrics(run)
    assert [r["epoch"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb):
        assert x["test_acc"] == y["test_acc"] and x["train_loss"] == pytest.approx(y["train_loss"])


@pytest.mark.parametrize("args,message", [
    (["--model", "alexnet"], "model 'alexnet' is invalid: allowed resnet18"),
    (["--epochs", "2", "--warmup-epochs", "2"], "--warmup-epochs 2 is invalid with --epochs 2"),
    (["--rank-ratio", "1.5"], "--rank-ratio 1.5 is out of range"),
    (["--data-dir", "/nonexistent/fmnist"], "/nonexistent/fmnist"),
    (["--batch-size", "zero"], "--batch-size 'zero' is invalid"),
    (["--mode", "magic"], "mode 'magic' is invalid"),
    (["--epochs", "4", "--warmup-epochs", "auto", "--max-warmup-epochs", "4"],
     "--max-warmup-epochs 4 are invalid with --epochs 4"),
    (["--rank-ratio", "auto", "--max-rank-ratio", "0"], "--max-rank-ratio 0.0 is out of range"),
    (["--warmup-epochs", "auto", "--switch-window", "0"], "--switch-window 0.0 is invalid"),
    (["--warmup-epochs", "auto", "--switch-threshold", "-1"], "--switch-threshold -1.0 is invalid"),
    (["--stable-rank-every-steps", "-2"], "--stable-rank-every-steps -2 is invalid"),
    (["--train-subset", "100000"], "--train-subset 100000 is invalid: allowed 0 (all) to 59936 "
     "(the training images of fashion-mnist less the 64 of --val-subset)"),
    (["--val-subset", "60000"], "--val-subset 60000 is invalid: allowed 0 (none) to 59999"),
    (["--val-subset", "-5"], "--val-subset -5 is invalid: allowed >= 0"),
    (["--test-subset", "20000"], "--test-subset 20000 is invalid: allowed 0 (all) to 10000"),
    # one process has no all-reduce: the hook would silently do nothing
    (["--comm", "powersgd"], "comm 'powersgd' is invalid without a process group"),
])
def test_bad_input_exits_2_with_one_line(args: list[str], message: str,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    # in this process (a real one's exit: tests/test_reliability.py's one-line checks)
    code, lines = cli_stderr(["train", *TINY, *args, "--out", "/tmp/pufferfish-never-written"],
                             capfd)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("pufferfish: error:") and message in lines[0]
    assert not Path("/tmp/pufferfish-never-written/metrics.jsonl").exists()


def test_corrupt_idx_file_exits_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    n = 8
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2051, [n, 28, 28], bytes(n * 784))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, [n], bytes(n))
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, [n, 28, 28], bytes(n * 100))  # cut
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 2049, [n], bytes(n))
    code, lines = cli_stderr(["train", *TINY, "--train-subset", "8", "--data-dir", str(tmp_path),
                              "--out", str(tmp_path / "run")], capfd)
    assert code == 2
    assert len(lines) == 1 and "t10k-images-idx3-ubyte.gz" in lines[0]


def test_config_file_and_unknown_key(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text('model = "vgg19_bn"\nwidth = 0.25\nepochs = 4\nwarmup_epochs = 1\n')
    cfg = load_config(good, {"lr": "0.01"})
    assert (cfg.model, cfg.width, cfg.epochs, cfg.warmup_epochs, cfg.lr) == ("vgg19_bn", 0.25, 4, "1", 0.01)
    bad = tmp_path / "bad.toml"
    bad.write_text("epocs = 3\n")
    code, lines = cli_stderr(["train", "--config", str(bad)], capfd)
    assert code == 2
    assert "unknown configuration key 'epocs' (did you mean 'epochs'?)" in "\n".join(lines)


@pytest.mark.skipif(not __import__("shutil").which("bible"), reason="bible-kjv missing")
def test_lstm_language_model_on_kjv(tmp_path: Path) -> None:
    out = tmp_path / "lm"
    result = run_cli("train", "--model", "lstm", "--data", "kjv", "--width", "0.02", "--max-vocab",
                     "500", "--train-subset", "4000", "--test-subset", "1000", "--epochs", "2",
                     "--warmup-epochs", "1", "--bptt", "10", "--batch-size", "8", "--lr", "20",
                     "--momentum", "0", "--grad-clip", "0.25", "--threads", "1", "--no-progress",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["lowrank"] for r in rows] == [False, True]
    assert rows[1]["test_ppl"] < 500  # better than uniform over the 500-word vocabulary
    assert "rnn" in (out / "factorization.txt").read_text()


@pytest.mark.skipif(not __import__("shutil").which("bible"), reason="bible-kjv missing")
def test_two_process_lm_equals_one_process_at_twice_the_batch(tmp_path: Path) -> None:
    # Rank r holds columns [r*B, (r+1)*B) of the 2B-column batchify, DDP averages the two halves'
    # mean losses, and clipping sees the averaged gradient: without dropout the 2-process run is
    # the 1-process run at batch 2B up to float summation order, before and after the switch.
    # (At lr 20 those last-bit differences grow chaotically after the switch: the reason why a
    # 1-process and a 2-process LM run can end far apart. Here lr 1 keeps the dynamics tame.)
    args = ["--model", "lstm", "--data", "kjv", "--width", "0.02", "--max-vocab", "300",
            "--train-subset", "3000", "--test-subset", "600", "--epochs", "2", "--warmup-epochs",
            "1", "--bptt", "10", "--dropout", "0", "--lr", "1", "--momentum", "0",
            "--grad-clip", "0.25", "--threads", "1", "--no-progress",
            "--kernel", "loop"]  # timed at the switch, the runs could pick kernels that round apart
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = run_cli("train", *args, "--batch-size", "8", "--out", str(one))
    r2 = run_cli("train", *args, "--batch-size", "4", "--out", str(two), torchrun=2)
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert r2.returncode == 0, r2.stderr[-3000:]
    rows1, rows2 = metrics(one), metrics(two)
    assert [r["lowrank"] for r in rows2] == [False, True]
    for a, b in zip(rows1, rows2, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["test_ppl"] == pytest.approx(a["test_ppl"], rel=1e-3)


@needs_fashion
def test_the_validation_split_is_the_same_for_every_seed_mode_and_rank() -> None:
    from pufferfish.distributed.env import DistEnv
    from pufferfish.training.tasks import ImageTask

    def task(rank: int, **changes: Any) -> ImageTask:
        cfg = load_config(None, {"model": "resnet18", "width": 0.125, "val_subset": 500,
                                 "threads": 1, **changes})
        return ImageTask(cfg, DistEnv(rank=rank, world_size=2))

    a, b = task(0), task(1, seed=7, mode="full")
    assert torch.equal(a.ds.val_images, b.ds.val_images) and len(a.ds.val_labels) == 500
    # The two ranks' shards together are the split, each example once.
    images = torch.empty_like(a.ds.val_images)
    images[0::2], images[1::2] = a.val[0], b.val[0]
    assert torch.equal(images, a.ds.val_images) and a.val[2] == b.val[2] == 500
    # --test-subset caps the evaluation of both splits: a quick run evaluates N of each
    capped = task(0, test_subset=64)
    assert capped.val[2] == capped.test[2] == 64 and len(capped.ds.val_labels) == 500
    # Held out of training: the loader trains on the other 59,500, --train-subset on their first.
    assert a.train_loader.dataset_size == 60_000 - 500
    c = task(0, train_subset=256)
    assert torch.equal(c.train_loader.images.cpu(), a.ds.train_images[:256])


def test_resume_with_another_validation_split_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pufferfish.cli import main
    from pufferfish.config import TrainConfig
    from pufferfish.configfile import dump_toml
    from pufferfish.training.checkpoint import save_checkpoint
    from pufferfish.training.startup import load_run_config

    run = tmp_path / "run"
    cfg = TrainConfig(model="resnet18", width=0.125, train_subset=64, val_subset=100,
                      batch_size=32, epochs=1, warmup_epochs="0", threads=1, progress=False,
                      out=str(run))
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(cfg))
    save_checkpoint(run, {"config": cfg.to_dict(), "model": {}, "epoch": 1}, 4)
    assert main(["train", "--resume", str(run), "--val-subset", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--val-subset: checkpoint has 100, this run has 200" in err
    # A run written before the field existed had no validation split: 0, not today's default.
    old = {k: v for k, v in cfg.to_dict().items() if k != "val_subset"}
    (run / "config.toml").write_text(dump_toml(cfg).replace("val_subset = 100\n", ""))
    save_checkpoint(run, {"config": old, "model": {}, "epoch": 1}, 8)
    assert load_run_config(run / "config.toml").val_subset == 0
    assert main(["train", "--resume", str(run), "--val-subset", "5000"]) == 2
    assert "--val-subset: checkpoint has 0, this run has 5000" in capsys.readouterr().err
