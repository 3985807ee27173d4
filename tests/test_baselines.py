"""The pruning baselines: LTH masks and rewinding, network-slimming surgery, CLI runs, resume."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import torch
from helpers import metrics, needs_fashion, run_cli
from torch import nn

from pufferfish import models
from pufferfish.baselines.common import output_layer_name
from pufferfish.baselines.lth import LotteryTicketMethod, prunable_modules, round_counts
from pufferfish.baselines.slimming import (
    SlimmingMethod,
    apply_plan,
    choose_plan,
    params_after,
    zero_channels,
)
from pufferfish.config import ConfigError, TrainConfig
from pufferfish.configfile import load_config
from pufferfish.training.checkpoint import latest_checkpoint

TINY = ["--model", "resnet18", "--width", "0.125", "--train-subset", "128", "--test-subset", "64",
        "--batch-size", "32", "--epochs", "1", "--rounds", "1", "--threads", "1", "--no-progress"]
X = torch.zeros(1, 1, 28, 28)


def small(name: str = "resnet18") -> nn.Module:
    return models.build_model(name, num_classes=10, in_channels=1, width=0.125, image_size=28)


@torch.no_grad()
def perturb(model: nn.Module, scale: float = 0.1) -> None:
    """Stand-in for an epoch of training: every parameter and BN statistic moves."""
    for p in model.parameters():
        p.add_(scale * torch.randn_like(p))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.add_(scale)


def masked_count(method: LotteryTicketMethod) -> int:
    return sum(int((~m).sum()) for m in method.masks.values())


# -- lottery ticket ------------------------------------------------------------------------------

def test_lth_prunes_20_percent_of_the_remaining_each_round_and_spares_output_bn_bias() -> None:
    model = small()
    cfg = TrainConfig(mode="lth", epochs=1, rounds=3)
    method = LotteryTicketMethod(cfg)
    method.setup(model, X, cfg)
    assert method.total_epochs(cfg) == 4
    assert "fc" not in method.modules and output_layer_name(model) == "fc"
    assert all(isinstance(m, nn.Conv2d) for m in method.modules.values())
    P = method.prunable
    assert sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Conv2d)) == P
    assert method.on_epoch_start(0, model) is None  # saves the rewind point only
    remaining = P
    for r in (1, 2, 3):
        perturb(model)
        change = method.on_epoch_start(r, model)
        assert change is not None and change.name == f"prune-round-{r}"
        expected = round(0.2 * remaining)
        assert masked_count(method) == P - remaining + expected  # exactly 20% of what was left
        remaining -= expected
        assert method.alive() == remaining
    assert not hasattr(model.fc, "weight_mask")
    for m in model.modules():  # BN and biases are never masked
        if isinstance(m, nn.BatchNorm2d):
            assert not any(n.endswith("_mask") for n, _ in m.named_buffers())
    assert all(not n.endswith("bias_mask") for n, _ in model.named_buffers())
    row = method.on_epoch_end(3, model)
    assert row["round"] == 3 and row["cost_epochs"] == 4
    assert row["density"] == pytest.approx(remaining / P)
    assert row["params"] == sum(p.numel() for p in model.parameters()) - (P - remaining)


def test_lth_late_rewinding_restores_the_saved_values() -> None:
    model = small()
    cfg = TrainConfig(mode="lth", epochs=2, rounds=1, rewind_epoch=1)
    method = LotteryTicketMethod(cfg)
    method.setup(model, X, cfg)
    method.on_epoch_start(0, model)
    assert not method.rewind  # k = 1: saved after the first epoch, not at init
    perturb(model)
    method.on_epoch_start(1, model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    perturb(model)
    assert method.on_epoch_start(2, model) is not None
    state = model.state_dict()
    for key, value in saved.items():  # all parameters and BN statistics, weights via weight_orig
        now = state[key] if key in state else state[key + "_orig"]
        assert torch.equal(now, value), key
    for name, module in method.modules.items():
        assert torch.equal(module.weight, saved[f"{name}.weight"] * method.masks[name]), name


def test_lth_masked_weights_stay_zero_through_training_steps() -> None:
    model = small()
    cfg = TrainConfig(mode="lth", epochs=1, rounds=1)
    method = LotteryTicketMethod(cfg)
    method.setup(model, X, cfg)
    method.on_epoch_start(0, model)
    method.on_epoch_start(1, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)),
                                           torch.randint(0, 10, (8,)))
        opt.zero_grad()
        loss.backward()
        for name, m in method.modules.items():
            assert m.weight_orig.grad[~method.masks[name]].abs().max() == 0
        opt.step()
    model(X)  # the pruning hooks recompute each weight from weight_orig and the mask
    for name, m in method.modules.items():
        assert m.weight[~method.masks[name]].abs().max() == 0, name
        assert m.weight[method.masks[name]].abs().min() > 0, name


def test_lth_target_params_is_hit_exactly_with_a_partial_last_round() -> None:
    assert round_counts(1000, 0.2, 0, keep=300) == [200, 160, 128, 102, 82, 28]
    assert round_counts(1000, 0.2, 2, keep=300) == [200, 160]  # rounds caps the schedule
    model = small()
    total = sum(p.numel() for p in model.parameters())
    cfg = TrainConfig(mode="lth", epochs=1, target_params=total // 3)
    method = LotteryTicketMethod(cfg)
    method.setup(model, X, cfg)
    for epoch in range(method.total_epochs(cfg)):
        method.on_epoch_start(epoch, model)
    assert method.nonzero_params(model) == total // 3
    tiny = TrainConfig(mode="lth", target_params=100)
    with pytest.raises(ConfigError, match="unreachable"):
        LotteryTicketMethod(tiny).setup(small(), X, tiny)


def test_lth_state_is_weights_only_and_restore_rebuilds_the_masks() -> None:
    model = small()
    cfg = TrainConfig(mode="lth", epochs=1, rounds=2)
    method = LotteryTicketMethod(cfg)
    method.setup(model, X, cfg)
    for epoch in range(2):
        method.on_epoch_start(epoch, model)
    buf = io.BytesIO()
    torch.save({"method": method.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh, again = small(), LotteryTicketMethod(cfg)
    again.setup(fresh, X, cfg)
    again.load_state_dict(saved["method"], fresh)
    fresh.load_state_dict(saved["model"])  # strict: weight_orig/weight_mask keys exist
    assert again.alive() == method.alive() and again.round == 1
    fresh.eval(), model.eval()
    assert torch.equal(fresh(X), model(X))
    chosen = prunable_modules(small(), ["layer4.*"])  # an explicit list replaces the default
    assert "layer4.0.conv1" not in chosen and "fc" in chosen


# -- structured pruning (network slimming) --------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet18", "vgg19_bn"])
def test_structured_pruning_is_smaller_and_matches_the_zeroed_channel_network(name: str) -> None:
    model = small(name)
    with torch.no_grad():  # a "trained" network: distinct scales, real statistics
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0, 1), m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
    dense = sum(p.numel() for p in model.parameters())
    plan = choose_plan(model, X, ratio=0.5)
    pruned, masked = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(pruned, X, plan)
    zero_channels(masked, X, plan)
    n = sum(p.numel() for p in pruned.parameters())
    assert n < dense / 2 and n == params_after(model, X, plan)
    pruned.eval(), masked.eval()
    x = torch.randn(4, 1, 28, 28)
    assert torch.allclose(pruned(x), masked(x), atol=1e-5)
    target = dense // 3
    by_target = copy.deepcopy(model)
    apply_plan(by_target, X, choose_plan(model, X, target_params=target))
    assert target * 0.97 < sum(p.numel() for p in by_target.parameters()) <= target
    out = output_layer_name(model)
    assert pruned.get_submodule(out).out_features == 10


def test_slimming_l1_phase_then_cut_and_restore_replays_the_plan() -> None:
    model = small()
    cfg = TrainConfig(mode="prune", epochs=4, prune_ratio=0.3)
    method = SlimmingMethod(cfg)
    method.setup(model, X, cfg)
    assert method.at == 2  # half the epochs
    l1 = method.extra_loss(model)
    bn_sum = sum(m.weight.abs().sum() for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert l1 is not None and torch.allclose(l1, 1e-4 * bn_sum)
    assert method.on_epoch_start(1, model) is None
    perturb(model)
    change = method.on_epoch_start(2, model)
    assert change is not None and change.record["params_after"] < change.record["params_before"]
    assert method.extra_loss(model) is None  # fine-tuning: no penalty
    buf = io.BytesIO()
    torch.save({"method": method.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh, again = small(), SlimmingMethod(cfg)
    again.setup(fresh, X, cfg)
    again.load_state_dict(saved["method"], fresh)
    fresh.load_state_dict(saved["model"])
    assert fresh.training and again.pruned
    fresh.eval(), model.eval()
    assert torch.equal(fresh(X), model(X))


@pytest.mark.parametrize("overrides,message", [
    ({"mode": "lth", "prune_rate": 1.0}, "prune_rate 1.0 is invalid"),
    ({"mode": "lth", "epochs": 2, "rewind_epoch": 2}, "rewind_epoch 2 is invalid with epochs 2"),
    ({"mode": "prune", "epochs": 2, "prune_epoch": 5}, "prune_epoch 5 is invalid"),
    ({"mode": "prune", "model": "lstm"}, "mode 'prune' is invalid with model 'lstm'"),
    ({"target_params": -1}, "target_params -1 is invalid"),
])
def test_bad_baseline_config(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# -- end to end -----------------------------------------------------------------------------------


LTH_ARGS = [*TINY, "--mode", "lth", "--checkpoint-every-steps", "3"]


@pytest.fixture(scope="module")
def lth_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CLI lottery-ticket run: checked as it is, and the reference for the resume test."""
    out = tmp_path_factory.mktemp("lth") / "ref"
    result = run_cli("train", *LTH_ARGS, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@needs_fashion
def test_cli_lth_run(lth_run: Path) -> None:
    rows = metrics(lth_run)
    assert [r["round"] for r in rows] == [0, 1] and [r["cost_epochs"] for r in rows] == [1, 2]
    assert rows[1]["density"] == pytest.approx(0.8, abs=1e-4)
    assert rows[1]["params"] < rows[0]["params"] and rows[1]["macs"] == rows[0]["macs"]
    assert (lth_run / "prune-round-1.json").exists()


@needs_fashion
def test_cli_prune_run(tmp_path: Path) -> None:
    # On oneDNN's AVX2 kernels (an AMD EPYC's, emulated here): the cut leaves layer2's shortcut a
    # strided 1x1 conv with 4 input channels, whose channels-last weight gradient corrupted the
    # heap ("double free or corruption") until it was kept NCHW (models/memory_format.py).
    result = run_cli("train", *TINY, "--mode", "prune", "--out", str(tmp_path),
                     env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "channel-pruning.json").read_text())
    rows = metrics(tmp_path)
    assert rows[-1]["params"] == record["params_after"] < record["params_before"]
    assert rows[-1]["pruned"] is True


@needs_fashion
def test_lth_resume_after_sigkill_between_rounds_gives_the_same_final_parameters(
        tmp_path: Path, lth_run: Path) -> None:
    # 4 steps per epoch, one round of pruning (epochs 0 and 1). Killed at step 4, between the
    # rounds, the run resumes from the epoch-end checkpoint and prunes and rewinds from the saved
    # rewind point; a resume inside a round (masks restored from the checkpoint) is covered in
    # process by test_lth_state_is_weights_only_and_restore_rebuilds_the_masks.
    run, marker = tmp_path / "run", tmp_path / "killed"
    killed = run_cli("train", *LTH_ARGS, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": "4", "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    resumed = run_cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    final, got = latest_checkpoint(lth_run)[0]["model"], latest_checkpoint(run)[0]["model"]
    assert got.keys() == final.keys()
    for key in final:
        assert torch.equal(got[key], final[key]), key
    assert [r["test_acc"] for r in metrics(run)] == [r["test_acc"] for r in metrics(lth_run)]


@needs_fashion
def test_compare_writes_the_matched_size_table(tmp_path: Path) -> None:
    from pufferfish.baselines.compare import compare

    cfg = load_config(None, {"model": "vgg19_bn", "width": 0.125, "train_subset": 64,
                             "val_subset": 32, "test_subset": 32, "batch_size": 32, "epochs": 1,
                             "warmup_epochs": "0", "prune_rate": 0.6, "threads": 1,
                             "progress": False})
    table = compare(cfg, tmp_path, methods=("pufferfish", "lth", "prune"), repeats=1)
    result = {r["method"]: r for r in json.loads((tmp_path / "compare.json").read_text())}
    target = result["pufferfish"]["params"]
    assert result["lth"]["params"] == target and result["prune"]["params"] <= target
    assert result["lth"]["epochs_trained"] > result["prune"]["epochs_trained"] == 1
    assert result["lth"]["macs"] > result["prune"]["macs"]
    assert "(dense)" in table and result["prune"]["latency_b1_ms"] > 0
    assert "32 training images held out for validation" in table  # passed to every run
    assert all(0 <= r["val_acc"] <= 1 for r in result.values())
    assert (tmp_path / "tradeoff.png").exists() and (tmp_path / "report.md").exists()
