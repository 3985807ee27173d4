"""The LM optimizer (AdamW with decay / no-decay groups), the switch in optimizer steps
(mid-epoch) and Adam's moments across it: real runs of a tiny transformer, real gloo groups."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import cli_stderr, killed_and_resumed, metrics, run_cli, tiny_transformer_args
from torch import nn

import pufferfish as pf
from pufferfish.config import TrainConfig
from pufferfish.configfile import load_config
from pufferfish.models import build_at_width, get_spec
from pufferfish.models import spec as spec_module
from pufferfish.models.llama import (
    LLAMA_LR_AT_EDGE,
    LLAMA_LR_MEASURED,
    LLAMA_METHOD_MEASURED,
    LLAMA_METHODS,
    llama_lr,
    llama_method,
)
from pufferfish.switch import projected_state
from pufferfish.training.checkpoint import latest_checkpoint
from pufferfish.training.optim import build_optimizer


def _names(model: nn.Module, params: list[torch.Tensor]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_adamw_groups_decay_weights_not_norms_biases_or_embeddings() -> None:
    model = build_at_width("transformer", 0.125, vocab_size=50)
    cfg = TrainConfig(model="transformer", data="kjv", optimizer="adamw", weight_decay=0.1)
    opt = build_optimizer(cfg, [{"params": list(model.parameters()), "weight_decay": 0.1}], model)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = _names(model, decay["params"])
    assert "encoder.layers.1.linear1.weight" in decayed
    assert "encoder.layers.1.self_attn.in_proj_weight" in decayed
    assert all(p.dim() >= 2 for p in decay["params"])
    rest = _names(model, no_decay["params"])
    # biases, norm scales, and the embeddings (the head is tied to embed.weight)
    assert {"embed.weight", "pos_embed.weight", "encoder.norm.weight",
            "encoder.layers.1.linear1.bias"} <= rest
    assert len(decayed) + len(rest) == len(list(model.parameters()))
    # The factors that replace a weight are decayed like it: by the rule in a rebuilt optimizer,
    # and in place (Recipe's swap_parameters) in the user's own AdamW.
    before = dict(model.named_parameters(remove_duplicate=False))
    pf.factorize(model, rank_ratio=0.25, preset="paper")
    rebuilt = build_optimizer(cfg, [{"params": list(model.parameters()),
                                     "weight_decay": 0.1}], model)
    factors = {n for n, p in model.named_parameters() if n not in before}
    assert factors and factors <= {n for n in _names(model, rebuilt.param_groups[0]["params"])
                                   } | {n for n in factors if n.endswith("bias")}
    pf.recipe.swap_parameters(opt, before, dict(model.named_parameters(remove_duplicate=False)))
    for n, p in model.named_parameters():
        if n in factors:
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            assert group["weight_decay"] == (0.1 if p.dim() >= 2 else 0.0), n


def test_optimizer_defaults_by_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # The paper's models keep SGD (the transformer too: its recipe is unchanged).
    for model in ("resnet18", "transformer"):
        assert load_config(overrides={"model": model}).optimizer_name == "sgd"
    assert get_spec("llama").defaults["optimizer"] == "adamw"
    # A model spec's defaults fill what the user did not set; a flag or the file wins.
    monkeypatch.setitem(spec_module._REGISTRY, "transformer", dataclasses.replace(
        get_spec("transformer"), defaults=get_spec("llama").defaults))
    cfg = load_config(overrides={"model": "transformer", "lr": "0.01"})
    assert (cfg.optimizer_name, cfg.lr, cfg.schedule) == ("adamw", 0.01, "cosine")
    assert TrainConfig(model="transformer", data="kjv").optimizer_name == "adamw"  # auto


def test_llama_lr_default_is_the_measured_one_and_scales_as_one_over_width_elsewhere() -> None:
    # at a measured width: the LR chosen on validation by the budget study; beyond: 1/width
    for width, lr in LLAMA_LR_MEASURED.items():
        assert load_config(overrides={"model": "llama", "width": width}).lr == lr
    widest = max(LLAMA_LR_MEASURED)
    assert load_config(overrides={"model": "llama"}).lr == pytest.approx(  # width 1
        LLAMA_LR_MEASURED[widest] * widest)
    assert load_config(overrides={"model": "llama", "width": 0.25, "lr": "3e-3"}).lr == 3e-3
    # between two measured widths: log-linear
    with _measured({0.125: 1e-2, 0.5: 1e-3}, {0.125: "lowrank", 0.5: "lowrank"}):
        assert llama_lr(0.25) == pytest.approx(10 ** -2.5)
        assert llama_lr(1.0) == pytest.approx(5e-4)
    # --help names the widths the advice was measured at, with what was chosen there
    shown = " ".join(run_cli("train", "--help").stdout.split())
    for width, lr in LLAMA_LR_MEASURED.items():
        edge = (f" (the {LLAMA_LR_AT_EDGE[width]} tried: the best may lie beyond)"
                if width in LLAMA_LR_AT_EDGE else "")
        assert (f"width {width:g}: lr {lr:g}{edge}, "
                f"{LLAMA_METHODS[LLAMA_METHOD_MEASURED[width]]}") in shown


@contextlib.contextmanager
def _measured(lrs: dict[float, float], methods: dict[float, str]) -> Iterator[None]:
    """The budget study's measured LRs and methods replaced for the block."""
    old = dict(LLAMA_LR_MEASURED), dict(LLAMA_METHOD_MEASURED)
    try:
        for table, new in ((LLAMA_LR_MEASURED, lrs), (LLAMA_METHOD_MEASURED, methods)):
            table.clear()
            table.update(new)
        yield
    finally:
        for table, saved in zip((LLAMA_LR_MEASURED, LLAMA_METHOD_MEASURED), old, strict=True):
            table.clear()
            table.update(saved)


def test_llama_method_default_is_the_nearest_measured_width_s_and_the_user_s_switch_wins() -> None:
    """Low rank from the start where it was chosen; Pufferfish's default switch (10% of the steps)
    where that was; between, the nearer measured width's (log scale); a warm-up the user sets wins."""
    def switch(**flags: object) -> tuple[str, float]:
        cfg = load_config(overrides={"model": "llama", **flags})
        return cfg.warmup_epochs, cfg.warmup_steps

    with _measured({0.125: 1e-2, 0.25: 3e-3}, {0.125: "lowrank", 0.25: "pufferfish"}):
        assert llama_method(0.125) == llama_method(0.0625) == llama_method(0.17) == "lowrank"
        assert llama_method(0.18) == llama_method(0.25) == llama_method(1.0) == "pufferfish"
        assert switch(width=0.125) == ("0", 0.0)
        assert switch(width=0.25) == ("0", 0.1)  # the switch in steps: 10% of the run
        assert switch(width=0.25, warmup_epochs="auto") == ("auto", 0.0)
        assert switch(width=0.25, warmup_epochs="1") == ("1", 0.0)
        assert switch(width=0.25, warmup_steps="0.05") == ("0", 0.05)
        assert switch(width=0.125, warmup_steps="0.05") == ("0", 0.05)
    assert llama_method(1.0) == LLAMA_METHOD_MEASURED[max(LLAMA_METHOD_MEASURED)]


@pytest.mark.parametrize("args,message", [
    (["--optimizer", "lamb"], "optimizer 'lamb' is invalid: allowed auto, sgd, adamw"),
    (["--warmup-steps", "2.5"], "--warmup-steps 2.5 is invalid"),
    (["--warmup-steps", "-1"], "--warmup-steps -1.0 is invalid"),
    (["--warmup-steps", "10", "--warmup-epochs", "auto"],
     "--warmup-steps is invalid with --warmup-epochs 'auto'"),
    (["--adam-betas", "0.9,1.5"], "--adam-betas [0.9, 1.5] are invalid"),
])
def test_bad_optimizer_input_exits_2(args: list[str], message: str,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    # in this process (a real one's exit: tests/test_reliability.py's one-line checks)
    code, lines = cli_stderr(["train", *args], capfd)
    assert code == 2, lines
    assert len(lines) == 1 and message in lines[0], lines


def test_warmup_steps_past_the_run_exits_2_before_writing(tmp_path: Path) -> None:
    """Refused once the data's step count is known, before the run writes anything: the same
    --out then takes the corrected command without --overwrite."""
    out = tmp_path / "run"
    result = run_cli("train", *tiny_transformer_args(tmp_path, "--epochs", "1",
                                                     "--warmup-steps", "59", "--out", str(out)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--warmup-steps 59 is invalid with 59 optimizer steps" in result.stderr
    assert not out.exists() or not any(out.iterdir())
    fixed = run_cli("train", *tiny_transformer_args(tmp_path, "--epochs", "1",
                                                    "--warmup-steps", "58", "--out", str(out)))
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert (out / "config.toml").is_file()


def test_projected_adam_state_follows_the_chain_rule() -> None:
    model = nn.Sequential(nn.Linear(12, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(5, 12)).square().sum().backward()
        opt.step()
    before = dict(model.named_parameters())
    dense = opt.state[model[0].weight]
    pf.factorize(model, rank_ratio=0.5)
    low = model[0]
    (left, right), = low.factor_pairs()
    carried = projected_state(opt.state, before, model)
    by_name = {n: carried[p] for n, p in low.named_parameters() if p in carried}
    assert set(by_name) == {n for n, _ in low.named_parameters()}  # factors and bias
    left_name = next(n for n, p in low.named_parameters() if p.shape == left.shape)
    right_name = next(n for n, p in low.named_parameters() if p.shape == right.shape
                      and n != left_name)
    m, v = dense["exp_avg"], dense["exp_avg_sq"]
    torch.testing.assert_close(by_name[left_name]["exp_avg"].reshape(left.shape), m @ right.T)
    torch.testing.assert_close(by_name[right_name]["exp_avg"].reshape(right.shape), left.T @ m)
    torch.testing.assert_close(by_name[left_name]["exp_avg_sq"].reshape(left.shape),
                               v @ (right * right).T)
    torch.testing.assert_close(by_name[right_name]["exp_avg_sq"].reshape(right.shape),
                               (left * left).T @ v)
    assert all(float(s["step"]) == 3 for s in by_name.values())  # bias correction kept
    bias = next(n for n in by_name if n.endswith("bias"))
    torch.testing.assert_close(by_name[bias]["exp_avg_sq"], opt.state[before["0.bias"]]["exp_avg_sq"])


def _factor_steps(run_dir: Path) -> set[float]:
    """Adam's step count of every factor in the newest checkpoint's optimizer state."""
    state, _ = latest_checkpoint(run_dir)
    return {float(s["step"]) for s in state["optimizer"]["state"].values()}


@pytest.mark.parametrize("momentum", ["reset", "project"])
def test_two_process_mid_epoch_switch_with_adamw(tmp_path: Path, momentum: str) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *tiny_transformer_args(
        tmp_path, "--epochs", "1", "--warmup-steps", "0.5", "--switch-momentum", momentum,
        "--out", str(out)), torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    # 2 processes: 30 steps per epoch each; the switch before step round(0.5 * 30) = 15
    assert "switching to the low-rank model at step 15 (epoch 0, step 15)" in result.stdout
    (row,) = metrics(out)
    assert row["lowrank"] and row["switch_epoch"] == 0
    # bytes per step over the whole epoch: half full-rank steps, half low-rank ones
    assert row["comm_bytes_per_step"] > 1.1 * 4 * row["params"]
    steps = _factor_steps(out)
    # reset: the new parameters and the survivors counted from the switch (30 - 15 steps);
    # project: every parameter keeps counting from the run's start (30 steps)
    assert steps == ({15.0} if momentum == "reset" else {30.0})


# Killed before the switch at step 15: the resumed run then projects Adam's moments. After a
# switch, AdamW's resume is test_llama.py's (bitwise).
@pytest.mark.parametrize("kill_step", [9])
def test_adamw_resume_around_a_mid_epoch_switch_is_exact(tmp_path: Path, kill_step: int) -> None:
    args = tiny_transformer_args(tmp_path, "--epochs", "1", "--train-subset", "1200",
                                 "--warmup-steps", "15",
                                 "--switch-momentum", "project", "--checkpoint-every-steps", "6")
    ref, run = killed_and_resumed(list(args), tmp_path, kill_step)
    a, b = latest_checkpoint(ref)[0], latest_checkpoint(run)[0]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for i, s in a["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
    assert metrics(ref)[0]["test_ppl"] == metrics(run)[0]["test_ppl"]
