"""The one training loop, whatever the task (images or language) and the method.

Full-rank, Pufferfish and low-rank-from-the-start runs differ only in the :class:`~pufferfish.Recipe`
(no recipe, warm-up ``N``, warm-up 0); the comm hook is a config value. The loop itself knows
nothing of low rank: at each epoch start it asks the recipe, and when the recipe switches it
rebuilds what depends on the parameters (optimizer, DDP wrapper, comm hook) through the same
functions it used at the start.

Determinism: every random draw is a function of ``(seed, epoch, step, rank)``: the data order of an
epoch comes from ``seed + epoch``, and the global RNG (dropout, augmentation) is reseeded at every
step. So a run resumed from any checkpoint, before or after the switch, replays exactly the steps
an uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig, dump_toml
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from ..lowrank import count_macs, factorize
from ..lowrank.base import LowRankModule
from ..recipe import Recipe
from . import checkpoint as ckpt
from .metrics import MetricsWriter
from .schedule import lr_at
from .tasks import Task, build_task

__all__ = ["TrainingError", "train"]


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, incompatible checkpoint); one-line message."""


@dataclass
class RunState:
    """What the loop mutates as it goes; everything a checkpoint must capture."""

    model: nn.Module  # the unwrapped model
    wrapped: nn.Module  # the DDP wrapper (or the model itself on one process)
    optimizer: torch.optim.Optimizer
    hook_state: Any = None
    scaler: Any = None
    epoch: int = 0
    step_in_epoch: int = 0  # steps of ``epoch`` already taken
    global_step: int = 0
    last_checkpoint: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def train(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Run one training job as configured; returns the metrics rows (one per epoch)."""
    env = dist_env.setup(cfg.backend, cfg.timeout_s)
    try:
        return _train(cfg, env)
    finally:
        dist_env.cleanup()


def _train(cfg: TrainConfig, env: DistEnv) -> list[dict[str, Any]]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = cfg.run_dir()
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    task = build_task(cfg, env)
    model = task.model.to(env.device)
    recipe = _make_recipe(cfg, task, env)
    writer = MetricsWriter(run_dir, enabled=env.is_main)
    resumed = ckpt.latest_checkpoint(run_dir) if cfg.resume else None

    if resumed is not None:
        saved, path = resumed
        _check_resumable(saved, cfg)
        ranks = saved["arch"]["ranks"]
        if ranks:  # rebuild the exact factorized architecture before loading weights
            factorize(model, include=list(ranks), overrides=ranks, rank_ratio=1.0,
                      extra_bn=cfg.extra_bn)
        if recipe is not None and saved["arch"]["switched_at"] is not None:
            recipe.switched_at = saved["arch"]["switched_at"]
        model.load_state_dict(saved["model"])
        writer.truncate(saved["epoch"] if saved["step_in_epoch"] == 0 else saved["epoch"] + 1)
    state = _prepare(cfg, model, env, recipe)
    if resumed is not None:
        state.optimizer.load_state_dict(saved["optimizer"])
        state.epoch, state.step_in_epoch = saved["epoch"], saved["step_in_epoch"]
        state.global_step = saved["global_step"]
        state.extra = saved.get("extra", {})
        if state.scaler is not None and saved.get("scaler"):
            state.scaler.load_state_dict(saved["scaler"])
        if state.hook_state is not None and saved.get("hook_states"):
            state.hook_state.load_state_dict(saved["hook_states"][env.rank])
        state.last_checkpoint = path
        _say(env, f"resumed from {path} at epoch {state.epoch}, step {state.step_in_epoch}")
    elif env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    _say(env, "configuration:\n" + _indent(dump_toml(cfg)))
    _say(env, f"{cfg.model} on {cfg.data}: {env.world_size} process(es), backend "
              f"{env.backend or 'none'}, device {env.device}, comm {cfg.comm}")

    while state.epoch < cfg.epochs:
        epoch = state.epoch
        if recipe is not None and state.step_in_epoch == 0:
            _maybe_switch(cfg, recipe, state, env, task, run_dir)
        row = _train_epoch(cfg, task, state, env, run_dir, recipe)
        row.update(task.evaluate(state.model, env))
        row.update(_model_figures(state, task, recipe, cfg))
        if recipe is not None and recipe.detector is not None and not recipe.switched:
            row["stable_ranks"] = recipe.observe(epoch + 1, state.model)
        writer.write(row)
        _say(env, _summary(row, cfg))
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if (epoch + 1) % cfg.checkpoint_every_epochs == 0 or epoch + 1 == cfg.epochs:
            _checkpoint(cfg, state, env, run_dir, recipe)
    if env.is_main:
        _say(env, writer.final_table())
    return writer.rows


# -- set-up ------------------------------------------------------------------------------------

def _make_recipe(cfg: TrainConfig, task: Task, env: DistEnv) -> Recipe | None:
    if cfg.mode not in ("pufferfish", "lowrank"):
        return None
    return Recipe(
        warmup_epochs=0 if cfg.mode == "lowrank" else cfg.warmup,
        rank_ratio=cfg.ratio,
        keep="auto" if cfg.keep_auto else cfg.keep,
        preset=None if cfg.preset == "none" else cfg.preset,
        keep_first=cfg.keep_first,
        extra_bn=cfg.extra_bn,
        example_input=task.example_input(env.device),
        max_warmup=max(1, cfg.epochs - 1),
    )


def param_groups(cfg: TrainConfig, model: nn.Module) -> list[dict[str, Any]]:
    """One group with plain weight decay; factor weights go without it under Frobenius decay."""
    if cfg.frobenius_decay <= 0:
        return [{"params": list(model.parameters()), "weight_decay": cfg.weight_decay}]
    from ..auto import frobenius_decay_params

    factors = {id(p) for p in frobenius_decay_params(model)}
    rest = [p for p in model.parameters() if id(p) not in factors]
    return [{"params": rest, "weight_decay": cfg.weight_decay},
            {"params": [p for p in model.parameters() if id(p) in factors], "weight_decay": 0.0}]


def _prepare(cfg: TrainConfig, model: nn.Module, env: DistEnv, recipe: Recipe | None,
             ) -> RunState:
    """Optimizer, DDP wrapper and comm hook for the model as it is now (start and switch)."""
    optimizer = torch.optim.SGD(param_groups(cfg, model), lr=cfg.lr, momentum=cfg.momentum,
                                nesterov=cfg.nesterov and cfg.momentum > 0,
                                weight_decay=cfg.weight_decay)
    wrapped = dist_env.wrap_ddp(model, env)
    hook_state = _register_hook(cfg, wrapped, env)
    scaler = (torch.amp.GradScaler("cuda") if cfg.amp and env.device.type == "cuda" else None)
    return RunState(model=model, wrapped=wrapped, optimizer=optimizer, hook_state=hook_state,
                    scaler=scaler)


def _register_hook(cfg: TrainConfig, wrapped: nn.Module, env: DistEnv) -> Any:
    if not env.distributed:
        return None
    from ..distributed.hooks import register_comm_hook

    options: dict[str, Any] = {}
    if cfg.comm == "powersgd":
        options = dict(matrix_approximation_rank=cfg.powersgd_rank,
                       start_powerSGD_iter=cfg.powersgd_start_iter)
    elif cfg.comm == "topk":
        options = dict(ratio=cfg.topk_ratio)
    elif cfg.comm == "signum":
        options = dict(beta=cfg.signum_beta)
    return register_comm_hook(wrapped, cfg.comm, **options)


def _maybe_switch(cfg: TrainConfig, recipe: Recipe, state: RunState, env: DistEnv, task: Task,
                  run_dir: Path) -> None:
    if not recipe.should_switch(state.epoch, state.model):
        return
    recipe.switch(state.epoch, state.model, None)
    fresh = _prepare(cfg, state.model, env, recipe)  # new optimizer (momentum reset), DDP, hook
    state.optimizer, state.wrapped, state.hook_state = fresh.optimizer, fresh.wrapped, fresh.hook_state
    state.extra.pop("macs", None)
    report = recipe.report
    _say(env, f"switching to the low-rank model at epoch {state.epoch}:\n{report}")
    if env.is_main:
        (run_dir / "factorization.txt").write_text(str(report) + "\n")
        (run_dir / "factorization.json").write_text(json.dumps(
            {"epoch": state.epoch, **report.to_dict(), "decisions": recipe.decisions},
            indent=1, default=str))


# -- one epoch ---------------------------------------------------------------------------------

def _train_epoch(cfg: TrainConfig, task: Task, state: RunState, env: DistEnv, run_dir: Path,
                 recipe: Recipe | None) -> dict[str, Any]:
    loader = task.train_loader
    loader.set_epoch(state.epoch)
    steps = len(loader)
    state.wrapped.train()
    task.start_epoch(state.epoch)
    amp = _autocast(cfg, env)
    # A mid-epoch resume continues the epoch's running loss where the checkpoint left it.
    partial = state.extra.pop("partial", None) or {"loss_sum": 0.0, "n_steps": 0}
    loss_sum = torch.tensor(partial["loss_sum"], dtype=torch.float64)
    n_steps, compute, data_wait = partial["n_steps"], 0.0, 0.0
    if state.hook_state is not None:
        state.hook_state.stats.reset()
    from tqdm import tqdm

    bar = tqdm(total=steps, initial=state.step_in_epoch, desc=f"epoch {state.epoch + 1}/{cfg.epochs}",
               disable=not (env.is_main and cfg.progress), leave=False, mininterval=1.0)
    start = time.perf_counter()
    t0 = start
    for i, batch in enumerate(loader):
        if i < state.step_in_epoch:  # resuming mid-epoch: these steps were taken before
            continue
        t1 = time.perf_counter()
        data_wait += t1 - t0
        _inject_fault(state.global_step, env)
        torch.manual_seed(_step_seed(cfg.seed, state.epoch, i, env.rank))
        lr = lr_at(cfg, state.global_step, steps)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        batch = task.to_device(batch, env.device)
        with amp:
            loss = task.loss(state.wrapped, batch)
            if cfg.frobenius_decay > 0:
                from ..auto import frobenius_decay

                loss = loss + frobenius_decay(state.model, cfg.frobenius_decay)
        state.optimizer.zero_grad(set_to_none=True)
        if state.scaler is not None:
            state.scaler.scale(loss).backward()
            state.scaler.unscale_(state.optimizer)
        else:
            loss.backward()
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(state.model.parameters(), cfg.grad_clip)
        if not math.isfinite(loss.item()):
            raise TrainingError(
                f"non-finite loss {loss.item()} at epoch {state.epoch}, step {i}; last good "
                f"checkpoint: {state.last_checkpoint or 'none'}")
        if state.scaler is not None:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        loss_sum += loss.detach().double().cpu()
        n_steps += 1
        state.global_step += 1
        state.step_in_epoch = i + 1
        t0 = time.perf_counter()
        compute += t0 - t1
        bar.update(1)
        if env.is_main and i % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.3g}")
        if cfg.checkpoint_every_steps and state.global_step % cfg.checkpoint_every_steps == 0 \
                and state.step_in_epoch < steps:
            state.extra["partial"] = {"loss_sum": loss_sum.item(), "n_steps": n_steps}
            _checkpoint(cfg, state, env, run_dir, recipe)
            state.extra.pop("partial")
    bar.close()
    epoch_time = time.perf_counter() - start
    total_loss, total_steps = dist_env.all_reduce_sum([loss_sum.item(), n_steps], env)
    row: dict[str, Any] = {
        "epoch": state.epoch + 1,
        "train_loss": total_loss / max(1, total_steps),
        "lr": lr_at(cfg, state.global_step - 1, steps),
        "epoch_time": epoch_time,
        "compute_time": compute,
        "data_time": data_wait,
    }
    stats = state.hook_state.stats.snapshot() if state.hook_state is not None else {}
    row["comm_bytes_per_step"] = stats.get("bytes_sent", 0.0) / max(1, n_steps)
    row["compress_time"] = stats.get("compress_time", 0.0)
    row["comm_time"] = stats.get("comm_time", 0.0)
    return row


def _inject_fault(global_step: int, env: DistEnv) -> None:
    """Fault injection for tests: SIGKILL this rank once, before global step N.

    ``PUFFERFISH_KILL_AT_STEP=N`` (and optionally ``PUFFERFISH_KILL_RANK``, default 0) arm it;
    ``PUFFERFISH_KILL_MARKER`` names a file created just before the kill, so that a restarted
    worker is not killed again at the same step.
    """
    at = os.environ.get("PUFFERFISH_KILL_AT_STEP")
    if at is None or int(at) != global_step or env.rank != int(os.environ.get("PUFFERFISH_KILL_RANK", 0)):
        return
    marker = Path(os.environ.get("PUFFERFISH_KILL_MARKER", "pufferfish-killed.marker"))
    if marker.exists():
        return
    marker.write_text(str(global_step))
    os.kill(os.getpid(), signal.SIGKILL)


def _autocast(cfg: TrainConfig, env: DistEnv) -> contextlib.AbstractContextManager:
    if not cfg.amp:
        return contextlib.nullcontext()
    if env.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 100_003 + step * 101 + rank) % (2**63)


def _model_figures(state: RunState, task: Task, recipe: Recipe | None, cfg: TrainConfig
                   ) -> dict[str, Any]:
    if "macs" not in state.extra:  # per example; recounted only when the architecture changes
        device = next(state.model.parameters()).device
        state.extra["macs"] = count_macs(state.model, task.example_input(device))
    lowrank = any(isinstance(m, LowRankModule) for m in state.model.modules())
    params = sum(p.numel() for p in state.model.parameters())
    return {"params": params, "macs": state.extra["macs"], "lowrank": lowrank,
            "grad_bytes": 4 * sum(p.numel() for p in state.model.parameters() if p.requires_grad),
            "switch_epoch": None if recipe is None else recipe.switched_at}


# -- checkpoints -------------------------------------------------------------------------------

def architecture(model: nn.Module) -> dict[str, int]:
    """Qualified name -> rank of every low-rank module: enough to rebuild the structure."""
    return {name: m.rank for name, m in model.named_modules() if isinstance(m, LowRankModule)}


def _checkpoint(cfg: TrainConfig, state: RunState, env: DistEnv, run_dir: Path,
                recipe: Recipe | None) -> None:
    hook_states = None
    if state.hook_state is not None:
        import torch.distributed as dist

        hook_states = [None] * env.world_size
        dist.all_gather_object(hook_states, state.hook_state.state_dict())
    if env.is_main:
        payload = {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.scaler.state_dict() if state.scaler is not None else {},
            "epoch": state.epoch,
            "step_in_epoch": state.step_in_epoch,
            "global_step": state.global_step,
            "arch": {"model": cfg.model, "ranks": architecture(state.model),
                     "switched_at": recipe.switched_at if recipe else None},
            "config": cfg.to_dict(),
            "hook_states": hook_states or [],
            "extra": {k: v for k, v in state.extra.items() if k == "partial"},
        }
        state.last_checkpoint = ckpt.save_checkpoint(run_dir, payload, state.global_step,
                                                     keep_last=cfg.keep_checkpoints)
    if env.distributed:
        import torch.distributed as dist

        dist.barrier()  # nobody runs ahead of a checkpoint that is still being written


def _check_resumable(saved: dict[str, Any], cfg: TrainConfig) -> None:
    keys = ("model", "width", "data", "mode", "rank_ratio", "preset", "extra_bn", "seed")
    ckpt.verify_compatible({k: saved["config"].get(k) for k in keys},
                           {k: getattr(cfg, k) for k in keys}, what="configuration")


# -- output ------------------------------------------------------------------------------------

def _say(env: DistEnv, text: str) -> None:
    if env.is_main:
        print(text, flush=True)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip().splitlines())


def _summary(row: dict[str, Any], cfg: TrainConfig) -> str:
    quality = (f"test_ppl {row['test_ppl']:.1f}" if "test_ppl" in row
               else f"test_acc {100 * row['test_acc']:.2f}%")
    return (f"epoch {row['epoch']}/{cfg.epochs} | train_loss {row['train_loss']:.4f} | {quality} | "
            f"params {row['params'] / 1e6:.2f}M | MACs {row['macs'] / 1e6:.1f}M | "
            f"{'low-rank' if row['lowrank'] else 'full-rank'} | {row['epoch_time']:.1f}s "
            f"(compute {row['compute_time']:.1f}s) | {row['comm_bytes_per_step'] / 1e6:.2f} MB/step")
