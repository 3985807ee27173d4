"""PufferfishCallback in the real Lightning Trainer: an MLP LightningModule on synthetic data.

One process: the switch at the right epoch or step, the Trainer's optimizer kept with its two
groups, the LR schedule (a per-step StepLR) identical to a run without the callback, resume from
a checkpoint written after the switch identical to the uninterrupted run. Two processes
(torchrun, ``strategy="ddp"`` on gloo): the switch on both ranks, the strategy's DDP wrapper
rebuilt in place, replicas identical after the switch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_trainer_run import data, make_module, make_probe, trainer
from torchrun_script import run_torchrun

from pufferfish.integrations.lightning import PufferfishCallback
from pufferfish.lowrank import LowRankModule


def _fit(callbacks: list[Any], ckpt_path: str | None = None, **overrides: Any) -> Any:
    torch.manual_seed(0)
    module = make_module()
    trainer(callbacks, 1, **overrides).fit(module, data(), ckpt_path=ckpt_path)
    return module


def test_switch_after_warmup_keeps_the_trainers_optimizer_and_schedule() -> None:
    callback = PufferfishCallback(warmup_epochs=1, rank_ratio=0.25, keep=["net.0"],
                                  verbose=False)
    probe = make_probe()
    module = _fit([callback, probe])

    assert callback.recipe.switched_at == 1 and callback.switcher.switched_at_step == 8
    report = callback.report
    assert report is not None and [d.name for d in report.factorized] == ["net.2", "net.4",
                                                                        "net.6"]
    assert report.params_after == sum(p.numel() for p in module.parameters()) == 5_384
    assert sum(isinstance(m, LowRankModule) for m in module.modules()) == 3
    assert probe.seen["wrapper"] == "Classifier"  # one process: no DDP
    assert probe.seen["same_optimizer"] and probe.seen["reducer_sees_factors"] is None

    optimizer = module.trainer.optimizers[0]
    assert module.trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    groups = optimizer.param_groups
    assert [(g["weight_decay"], g["initial_lr"]) for g in groups] == [(0.01, 1e-2), (0.0, 5e-3)]
    assert {id(p) for p in groups[0]["params"]} == {
        id(p) for p in module.parameters() if p.dim() >= 2}  # factors where the weights were
    assert {id(p) for p in groups[1]["params"]} == {
        id(p) for p in module.parameters() if p.dim() < 2}

    without = _fit([])
    assert module.lrs == without.lrs  # the LR schedule is exactly the Trainer's own
    assert len({tuple(lr) for lr in module.lrs[8:]}) > 1  # and it moves after the switch
    assert len(module.losses) == 24 and all(math.isfinite(v) for v in module.losses)
    assert sum(module.losses[-8:]) < sum(module.losses[:8])  # it still learns


def test_step_based_switch() -> None:
    callback = PufferfishCallback(warmup_steps=5, verbose=False)
    module = _fit([callback], max_steps=7, max_epochs=-1)
    assert module.trainer.global_step == 7
    assert callback.switcher.switched_at_step == 5 and callback.recipe.switched_at == 0
    assert sum(isinstance(m, LowRankModule) for m in module.modules()) == 4


def test_resume_after_the_switch_continues_the_same_run(tmp_path: Path) -> None:
    def run(ckpt_path: str | None = None) -> tuple[Any, PufferfishCallback]:
        # the last layer kept: the switched optimizer holds it before the factors, a fresh one
        # built on the factorized model after them (the order the callback's state restores)
        callback = PufferfishCallback(warmup_epochs=1, keep=["net.6"], verbose=False)
        save = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1,
                               filename="{epoch}")
        module = _fit([callback, save], ckpt_path, enable_checkpointing=True)
        return module, callback

    whole, _ = run()
    resumed, callback = run(str(tmp_path / "epoch=1.ckpt"))  # written after the switch
    assert callback.recipe.switched_at == 1 and callback.report is None  # no second switch
    assert resumed.lrs == whole.lrs[16:]
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)  # factorized weights and Adam moments on the right tensors


def test_two_processes_switch_together_and_stay_identical(tmp_path: Path) -> None:
    ranks = run_torchrun("lightning_trainer_run.py", tmp_path)
    for r in ranks:
        assert r["world"] == 2 and r["switched_at"] == 1 and r["switched_at_step"] == 4
        assert r["lowrank_modules"] == 3 and r["params_after"] == 5_384
        assert r["wrapper"] == "DistributedDataParallel"
        assert r["same_wrapper"] and r["same_optimizer"]  # rebuilt in place, not replaced
        assert r["reducer_sees_factors"] and r["options_kept"]
        assert r["wrapper_hook_calls"] == 12  # a hook on the wrapper itself survives the rebuild
        # the user's comm hook ran on every step, after the
        # switch on the rebuilt reducer: 4 steps per epoch, 1 bucket
        assert r["hook_calls"] == {"before_switch": 4, "after_switch": 8}
        # different initial weights and data on each rank; 8 steps after the switch: gradients
        # of the factors were all-reduced, or the replicas would have drifted apart
        assert r["replica_gap"] == 0.0
        assert all(math.isfinite(v) for v in r["losses"])
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank saw its own shard
    assert ranks[0]["lrs"] == ranks[1]["lrs"]


def test_automatic_switch_and_ranks_observe_four_times_an_epoch() -> None:
    callback = PufferfishCallback(warmup_epochs="auto", rank_ratio="auto", max_warmup=2,
                                  verbose=False)
    module = _fit([callback])
    recipe = callback.recipe
    assert recipe.switched_at in (1, 2)  # the detector fired, at the latest at the cap
    assert recipe.describe_decisions().startswith(f"switch epoch (auto): {recipe.switched_at}")
    times = [t for t, _ in recipe.tracker.history["net.2"]]
    assert times[:5] == [0, 0.25, 0.5, 0.75, 1.0]  # at the start, then 4 times an epoch
    ranks = recipe.decisions["ranks"]
    assert set(ranks) == {"net.0", "net.2", "net.4", "net.6"}
    assert {n: r for n, r in callback.report.ranks.items()} == {
        n: r for n, r in ranks.items() if n in callback.report.ranks}
    assert all(math.isfinite(v) for v in module.losses)
