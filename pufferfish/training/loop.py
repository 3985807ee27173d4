"""The one training loop, whatever the task (images or language) and the method.

Full-rank, Pufferfish, low-rank-from-the-start and the pruning baselines differ only in the
:class:`~pufferfish.training.method.Method` the loop is given; the comm hook is a config value. The
loop knows nothing of low rank: at each epoch start it asks the method, and when the method has
changed the model it rebuilds what depends on the parameters (optimizer, DDP wrapper, comm hook)
through the same function that built them at the start.

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
from ..lowrank import count_macs
from ..lowrank.base import LowRankModule
from . import checkpoint as ckpt
from .method import Change, Method
from .methods import build_method
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


def train(cfg: TrainConfig, method: Method | None = None) -> list[dict[str, Any]]:
    """Run one training job as configured; returns the metrics rows (one per epoch).

    ``method`` defaults to the one registered for ``cfg.mode``.
    """
    method = method if method is not None else build_method(cfg)
    env = dist_env.setup(cfg.backend, cfg.timeout_s)
    try:
        return _train(cfg, env, method)
    finally:
        dist_env.cleanup()


def _train(cfg: TrainConfig, env: DistEnv, method: Method) -> list[dict[str, Any]]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = cfg.run_dir()
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    task = build_task(cfg, env)
    model = task.model.to(env.device)
    method.setup(model, task.example_input(env.device), cfg)
    writer = MetricsWriter(run_dir, enabled=env.is_main)
    resumed = ckpt.latest_checkpoint(run_dir) if cfg.resume else None

    if resumed is not None:
        saved, path = resumed
        _check_resumable(saved, cfg)
        method.restore(saved["method"], model)  # e.g. rebuild the factorized architecture
        _load_model(model, saved["model"], path)
        writer.truncate(saved["epoch"] if saved["step_in_epoch"] == 0 else saved["epoch"] + 1)
    state = _prepare(cfg, model, env)
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
    _say(env, f"{cfg.model} on {cfg.data}, mode {cfg.mode}: {env.world_size} process(es), "
              f"backend {env.backend or 'none'}, device {env.device}, comm {cfg.comm}")

    total = method.total_epochs(cfg)
    while state.epoch < total:
        epoch = state.epoch
        if state.step_in_epoch == 0:
            change = method.on_epoch_start(epoch, state.model)
            if change is not None:
                _rebuild(cfg, state, env, change, run_dir)
        row = _train_epoch(cfg, task, state, env, run_dir, method)
        row.update(task.evaluate(state.model, env))
        row.update(_model_figures(state, task))
        row.update(method.on_epoch_end(epoch, state.model))
        writer.write(row)
        _say(env, _summary(row, total))
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if (epoch + 1) % cfg.checkpoint_every_epochs == 0 or epoch + 1 == total:
            _checkpoint(cfg, state, env, run_dir, method)
    if env.is_main:
        _say(env, writer.final_table())
    return writer.rows


# -- set-up ------------------------------------------------------------------------------------

def param_groups(cfg: TrainConfig, model: nn.Module) -> list[dict[str, Any]]:
    """One group with plain weight decay; factor weights go without it under Frobenius decay."""
    if cfg.frobenius_decay <= 0:
        return [{"params": list(model.parameters()), "weight_decay": cfg.weight_decay}]
    from ..auto import frobenius_decay_params

    factors = {id(p) for p in frobenius_decay_params(model)}
    rest = [p for p in model.parameters() if id(p) not in factors]
    return [{"params": rest, "weight_decay": cfg.weight_decay},
            {"params": [p for p in model.parameters() if id(p) in factors], "weight_decay": 0.0}]


def _prepare(cfg: TrainConfig, model: nn.Module, env: DistEnv) -> RunState:
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


def _rebuild(cfg: TrainConfig, state: RunState, env: DistEnv, change: Change,
             run_dir: Path) -> None:
    """After the method changed the model: new optimizer (fresh state), DDP wrapper, comm hook."""
    fresh = _prepare(cfg, state.model, env)
    state.optimizer, state.wrapped, state.hook_state = fresh.optimizer, fresh.wrapped, fresh.hook_state
    state.extra.pop("macs", None)
    _say(env, change.text)
    if env.is_main:
        (run_dir / f"{change.name}.txt").write_text(change.text + "\n")
        (run_dir / f"{change.name}.json").write_text(json.dumps(change.record, indent=1,
                                                                default=str))


# -- one epoch ---------------------------------------------------------------------------------

def _train_epoch(cfg: TrainConfig, task: Task, state: RunState, env: DistEnv, run_dir: Path,
                 method: Method) -> dict[str, Any]:
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
        lr = lr_at(cfg, method.schedule_step(state.global_step, steps), steps)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        batch = task.to_device(batch, env.device)
        with amp:
            loss = task.loss(state.wrapped, batch)
            if cfg.frobenius_decay > 0:
                from ..auto import frobenius_decay

                loss = loss + frobenius_decay(state.model, cfg.frobenius_decay)
            extra = method.extra_loss(state.model)
            if extra is not None:
                loss = loss + extra
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
            _checkpoint(cfg, state, env, run_dir, method)
            state.extra.pop("partial")
    bar.close()
    epoch_time = time.perf_counter() - start
    total_loss, total_steps = dist_env.all_reduce_sum([loss_sum.item(), n_steps], env)
    row: dict[str, Any] = {
        "epoch": state.epoch + 1,
        "train_loss": total_loss / max(1, total_steps),
        "lr": lr_at(cfg, method.schedule_step(state.global_step - 1, steps), steps),
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


def _model_figures(state: RunState, task: Task) -> dict[str, Any]:
    if "macs" not in state.extra:  # per example; recounted only when the architecture changes
        device = next(state.model.parameters()).device
        state.extra["macs"] = count_macs(state.model, task.example_input(device))
    trainable = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
    return {"params": sum(p.numel() for p in state.model.parameters()),
            "macs": state.extra["macs"],
            "lowrank": any(isinstance(m, LowRankModule) for m in state.model.modules()),
            "grad_bytes": 4 * trainable}


# -- checkpoints -------------------------------------------------------------------------------

def _checkpoint(cfg: TrainConfig, state: RunState, env: DistEnv, run_dir: Path,
                method: Method) -> None:
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
            "method": method.state_dict(),
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
    """The run being resumed must be the run that was saved (flags may change the rest)."""
    keys = ("model", "width", "data", "mode", "warmup_epochs", "rank_ratio", "preset", "keep",
            "keep_first", "extra_bn", "seed", "train_subset", "batch_size")
    ckpt.verify_compatible({k: saved["config"].get(k) for k in keys},
                           {k: getattr(cfg, k) for k in keys}, what="configuration")


def _load_model(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Load a checkpoint's weights; a checkpoint of another architecture is a named error."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [k for k in own if k in weights and own[k].shape != weights[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected),
                                    ("different shape", shapes)) if keys]
        raise ckpt.CheckpointError(f"checkpoint {path} does not fit this model ({'; '.join(parts)})")
    model.load_state_dict(weights)


# -- output ------------------------------------------------------------------------------------

def _say(env: DistEnv, text: str) -> None:
    if env.is_main:
        print(text, flush=True)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip().splitlines())


def _summary(row: dict[str, Any], total_epochs: int) -> str:
    quality = (f"test_ppl {row['test_ppl']:.1f}" if "test_ppl" in row
               else f"test_acc {100 * row['test_acc']:.2f}%")
    return (f"epoch {row['epoch']}/{total_epochs} | train_loss {row['train_loss']:.4f} | {quality} | "
            f"params {row['params'] / 1e6:.2f}M | MACs {row['macs'] / 1e6:.1f}M | "
            f"{'low-rank' if row['lowrank'] else 'full-rank'} | {row['epoch_time']:.1f}s "
            f"(compute {row['compute_time']:.1f}s) | {row['comm_bytes_per_step'] / 1e6:.2f} MB/step")
