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

Reliability (``docs/reliability.md``): under ``torchrun --max-restarts K`` a restarted group resumes
from the newest complete checkpoint of its run directory by itself; at start every rank checks that
all ranks have the same configuration, data and resume point; a peer that crashes or freezes is a
one-line :class:`PeerError` within the process-group timeout; a non-finite loss or gradient stops
(or skips the step) on every rank at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig, dump_toml
from ..data import DataError
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from ..lowrank import count_macs
from ..lowrank.base import LowRankModule
from . import checkpoint as ckpt
from . import faults, startup
from .method import Change, Method
from .methods import build_method
from .metrics import MetricsWriter
from .schedule import lr_at
from .tasks import Task, build_task

__all__ = ["PeerError", "TrainingError", "train"]


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, incompatible checkpoint); one-line message."""


class PeerError(RuntimeError):
    """Another process of the group crashed, was killed or froze; this one cannot continue.

    Separate from :class:`TrainingError` because nothing is wrong with this process's input: the
    CLI reports it in one line with exit status 1 (not 2), and the reason is in the peer's log.
    """




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

    ``method`` defaults to the one registered for ``cfg.mode``. In a process group, a failure of
    the group itself (a peer crashed, froze, or never came) is raised as :class:`PeerError`.
    The group is gone when this returns (drained first) or raises (not drained: end the process
    with :func:`pufferfish.distributed.env.exit_process`, as ``python -m pufferfish`` does).
    """
    method = method if method is not None else build_method(cfg)
    try:
        env = dist_env.setup(cfg.backend, cfg.timeout_s)
    except RuntimeError as e:
        if not _is_peer_failure(e):
            raise
        raise PeerError(f"could not form the process group of {os.environ.get('WORLD_SIZE')} "
                        f"processes within --timeout-s {cfg.timeout_s:g}: {_gloo_text(e)}") from e
    finished = False  # every rank ran to the end: the group can be drained (see cleanup)
    try:
        rows = _train(cfg, env, method)
        finished = True
        return rows
    except RuntimeError as e:
        if not env.distributed or isinstance(e, TrainingError | ckpt.CheckpointError) \
                or not _is_peer_failure(e):
            raise
        raise PeerError(f"rank {env.rank} lost contact with the other processes ({_gloo_text(e)}); "
                        "a peer crashed, was killed or froze: see its log") from e
    finally:
        dist_env.cleanup(drain=finished)


def _train(cfg: TrainConfig, env: DistEnv, method: Method) -> list[dict[str, Any]]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = cfg.run_dir()
    # First collective of the run, before anything whose collectives depend on the configuration
    # (the download barrier, DDP): mismatched configurations fail here, by name, on every rank.
    startup.check_config_agrees(cfg, env)
    # Before anything is written or loaded: rank 0 decides what happens to the run directory
    # (resume, start, or refuse) and every rank learns it.
    resumed = startup.find_resume_point(cfg, env, run_dir)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    task = build_task(cfg, env)
    model = task.model.to(env.device)
    method.setup(model, task.example_input(env.device), cfg)
    writer = MetricsWriter(run_dir, enabled=env.is_main)
    startup.check_agree(env, "the data or the checkpoint to resume", {
        **startup.data_fingerprint(task),
        "resume_from": None if resumed is None else resumed[1].name}, DataError)

    if resumed is not None:
        saved, path = resumed
        method.restore(saved["method"], model)  # e.g. rebuild the factorized architecture
        startup.load_model(model, saved["model"], path)
        # Rows of epochs completed before the checkpoint stay; a row of the epoch being redone
        # (written just before a kill that beat the epoch-end checkpoint) goes.
        with _signals_deferred():
            writer.truncate(saved["epoch"])
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
        # Per-rank progress within the epoch: this rank's own running loss (so the epoch's mean
        # is summed in the same order as without the interruption) and the task's carried state.
        rank_states = saved.get("rank_states") or []
        mine = rank_states[env.rank] if env.rank < len(rank_states) else {}
        if rank_states:  # (older checkpoints held rank 0's running loss in "extra")
            state.extra.pop("partial", None)
        if mine.get("partial"):
            state.extra["partial"] = mine["partial"]
        if mine.get("task"):
            state.extra["task_state"] = mine["task"]
        state.last_checkpoint = path
        dist_env.say(env, f"resumed from {path} at epoch {state.epoch}, step {state.step_in_epoch}")
    if env.is_main:
        # The effective configuration, also on resume (flags may have changed, e.g. --epochs), so
        # that a later --resume continues this run as it is now; without the resume request, and
        # without --overwrite (a later fork from this run must not inherit it).
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_text(run_dir / "config.toml",
                    dump_toml(dataclasses.replace(cfg, resume="", overwrite=False)))
    dist_env.say(env, "configuration:\n" + _indent(dump_toml(cfg)))
    dist_env.say(env, f"{cfg.model} on {cfg.data}, mode {cfg.mode}: {env.world_size} process(es), "
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
        with _signals_deferred():
            writer.write(row)
        dist_env.say(env, _summary(row, total))
        state.epoch, state.step_in_epoch = epoch + 1, 0
        if (epoch + 1) % cfg.checkpoint_every_epochs == 0 or epoch + 1 == total:
            _checkpoint(cfg, state, env, run_dir, method, task)
    if env.is_main:
        dist_env.say(env, writer.final_table())
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
    from ..distributed.hooks import hook_options, register_comm_hook

    return register_comm_hook(wrapped, cfg.comm, **hook_options(cfg.comm, cfg))


def _rebuild(cfg: TrainConfig, state: RunState, env: DistEnv, change: Change,
             run_dir: Path) -> None:
    """After the method changed the model: new optimizer (fresh state), DDP wrapper, comm hook."""
    fresh = _prepare(cfg, state.model, env)
    state.optimizer, state.wrapped, state.hook_state = fresh.optimizer, fresh.wrapped, fresh.hook_state
    state.extra.pop("macs", None)
    dist_env.say(env, change.text)
    if env.is_main:
        _write_text(run_dir / f"{change.name}.txt", change.text + "\n")
        _write_text(run_dir / f"{change.name}.json",
                    json.dumps(change.record, indent=1, default=str))


# -- one epoch ---------------------------------------------------------------------------------

def _train_epoch(cfg: TrainConfig, task: Task, state: RunState, env: DistEnv, run_dir: Path,
                 method: Method) -> dict[str, Any]:
    loader = task.train_loader
    loader.set_epoch(state.epoch)
    steps = len(loader)
    state.wrapped.train()
    task.start_epoch(state.epoch)
    task_state = state.extra.pop("task_state", None)
    if task_state:  # mid-epoch resume: e.g. the LSTM's hidden state carried across BPTT chunks
        _load_task_state(task, task_state, env.device)
    amp = _autocast(cfg, env)
    # A mid-epoch resume continues the epoch's running loss where the checkpoint left it.
    partial = state.extra.pop("partial", None) or {"loss_sum": 0.0, "n_steps": 0}
    loss_sum = torch.tensor(partial["loss_sum"], dtype=torch.float64)
    n_steps, compute, data_wait = partial["n_steps"], 0.0, 0.0
    skipped = partial.get("skipped", 0)  # steps whose update was skipped (--nonfinite skip)
    local_steps = 0  # steps taken by this process in this epoch (the comm stats cover these)
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
        faults.strike("step", state.global_step, env.rank)  # tests and benchmarks/faults.sh
        torch.manual_seed(_step_seed(cfg.seed, state.epoch, i, env.rank))
        lr = lr_at(cfg, method.schedule_step(state.global_step, steps), steps)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        batch = task.to_device(batch, env.device)
        # Skipping a step must also undo what the forward pass itself changed: BatchNorm running
        # statistics (a NaN batch would poison them for good) and the task's carried state.
        undo = _snapshot(state.model, task) if cfg.nonfinite == "skip" else None
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
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        bad = _nonfinite_votes(loss, grads if state.scaler is None else [],
                               list(state.model.buffers()), env)
        if bad is not None:
            if cfg.nonfinite == "stop":
                raise TrainingError(
                    f"non-finite {bad} at epoch {state.epoch}, step {i} (global step "
                    f"{state.global_step}); last good checkpoint: "
                    f"{state.last_checkpoint or 'none'}; lower --lr, set --grad-clip, or use "
                    "--nonfinite skip")
            state.optimizer.zero_grad(set_to_none=True)  # the step is skipped on every rank
            if undo is not None:
                undo()
            if state.scaler is not None:
                state.scaler.update()
            skipped += 1
        elif state.scaler is not None:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        if bad is None:
            loss_sum += loss.detach().double().cpu()
            n_steps += 1
        local_steps += 1
        state.global_step += 1
        state.step_in_epoch = i + 1
        method.on_step_end(state.epoch, i + 1, steps, state.model)
        t0 = time.perf_counter()
        compute += t0 - t1
        bar.update(1)
        if env.is_main and i % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.3g}")
        if cfg.checkpoint_every_steps and state.global_step % cfg.checkpoint_every_steps == 0 \
                and state.step_in_epoch < steps:
            state.extra["partial"] = {"loss_sum": loss_sum.item(), "n_steps": n_steps,
                                      "skipped": skipped}
            _checkpoint(cfg, state, env, run_dir, method, task)
            state.extra.pop("partial")
    bar.close()
    epoch_time = time.perf_counter() - start
    total_loss, total_steps = dist_env.all_reduce_sum([loss_sum.item(), n_steps], env)
    row: dict[str, Any] = {
        "epoch": state.epoch + 1,
        # Mean over the steps that were applied (NaN if every step of the epoch was skipped).
        "train_loss": total_loss / total_steps if total_steps else float("nan"),
        "skipped_steps": skipped,
        "lr": lr_at(cfg, method.schedule_step(state.global_step - 1, steps), steps),
        "epoch_time": epoch_time,
        "compute_time": compute,
        "data_time": data_wait,
    }
    stats = state.hook_state.stats.snapshot() if state.hook_state is not None else {}
    # Per step this process took: after a mid-epoch resume the stats cover only those.
    row["comm_bytes_per_step"] = stats.get("bytes_sent", 0.0) / max(1, local_steps)
    row["compress_time"] = stats.get("compress_time", 0.0)
    row["comm_time"] = stats.get("comm_time", 0.0)
    return row


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
                method: Method, task: Task) -> None:
    """Rank 0 writes the checkpoint; every rank learns whether it worked.

    Per-rank state (comm hook memory; mid-epoch, each rank's running loss and the task's carried
    state such as the LSTM's hidden state) is all-gathered so one file resumes every rank exactly.
    The outcome is broadcast instead
    of a bare barrier, so a failed write (disk full, permissions) stops every rank at once with
    rank 0's message, not rank 0 alone while the others wait out the timeout.
    """
    finite = _all_finite([*state.model.state_dict().values(), *_tensors(state.optimizer.state)])
    if dist_env.all_reduce_sum([0.0 if finite else 1.0], env)[0]:
        # The steps' losses and gradients were finite but the update overflowed the weights.
        raise TrainingError(
            f"non-finite parameters or optimizer state after epoch {state.epoch}, step "
            f"{state.step_in_epoch} (global step {state.global_step}): not saved; last good "
            f"checkpoint: {state.last_checkpoint or 'none'}; lower --lr or set --grad-clip")
    hook_states = dist_env.gather_object(state.hook_state.state_dict() if state.hook_state is not None else None,
                          env)
    rank_state: dict[str, Any] = {}
    if state.step_in_epoch:
        rank_state["partial"] = state.extra.get("partial")
        rank_state["task"] = _task_state(task)
    rank_states = dist_env.gather_object(rank_state, env)
    written = error = None
    if env.is_main:
        payload = {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.scaler.state_dict() if state.scaler is not None else {},
            "epoch": state.epoch,
            "step_in_epoch": state.step_in_epoch,
            "global_step": state.global_step,
            "world_size": env.world_size,
            "method": method.state_dict(),
            "config": cfg.to_dict(),
            "hook_states": hook_states if state.hook_state is not None else [],
            "rank_states": rank_states if any(rank_states) else [],
        }
        try:
            with _signals_deferred():  # Ctrl-C / SIGTERM wait for the write (or its cleanup)
                written = str(ckpt.save_checkpoint(run_dir, payload, state.global_step,
                                                   keep_last=cfg.keep_checkpoints))
        except ckpt.CheckpointError as e:
            error = str(e)
    # Also the barrier: nobody runs ahead of a checkpoint that is still being written.
    written, error = dist_env.broadcast_object((written, error), env)
    if error is not None:
        raise ckpt.CheckpointError(error if env.is_main else f"rank 0 failed: {error}")
    state.last_checkpoint = Path(written)  # every rank can name the last good checkpoint


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (the optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _task_state(task: Task) -> dict[str, Any]:
    """What a task carries from step to step within an epoch (the LSTM's hidden state), on CPU."""
    hidden = getattr(task, "hidden", None)
    if hidden is None:
        return {}
    return {"hidden": [h.detach().cpu() for h in hidden]}


def _load_task_state(task: Task, saved: dict[str, Any], device: torch.device) -> None:
    if saved.get("hidden") is not None and hasattr(task, "hidden"):
        task.hidden = tuple(h.to(device) for h in saved["hidden"])


# -- failures, signals and files ---------------------------------------------------------------

_PEER_FAILURE = re.compile(r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe|"
                           r"[Ss]ocket|peer|[Gg]loo|NCCL|[Ww]atchdog")


def _is_peer_failure(e: BaseException) -> bool:
    """A failure of the process group (peer gone or frozen), not of this process's work."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or bool(_PEER_FAILURE.search(str(e)))


def _gloo_text(e: BaseException) -> str:
    """The first line of a c10d/gloo error without its source-file prefix."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0] if lines else type(e).__name__)
    text = text.split(". This is typically")[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _snapshot(model: nn.Module, task: Task) -> Callable[[], None]:
    """A function that restores the model's buffers and the task's carried state as they are now."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    hidden = getattr(task, "hidden", None)

    def restore() -> None:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        if hasattr(task, "hidden"):
            task.hidden = hidden

    return restore


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is finite; the max-abs norm is exact (a 2-norm of huge but finite
    values overflows to inf) and propagates NaN."""
    tensors = [t for t in tensors if t.is_floating_point()]
    return not tensors or math.isfinite(nn.utils.get_total_norm(tensors, math.inf).item())


def _nonfinite_votes(loss: torch.Tensor, grads: list[torch.Tensor],
                     buffers: list[torch.Tensor], env: DistEnv) -> str | None:
    """What is non-finite on any rank (None: nothing); the same answer on every rank.

    Each rank votes on its loss, its gradients and its buffers (the forward pass has just updated
    the BatchNorm statistics: a batch can overflow them while the loss is still finite), and the
    votes are summed over ranks, so a NaN on one rank stops (or skips the step on) all of them
    together: a rank that stopped alone would leave the others waiting in the next collective.
    """
    votes = [0.0 if math.isfinite(loss.item()) else 1.0, 0.0 if _all_finite(grads) else 1.0,
             0.0 if _all_finite(buffers) else 1.0]
    votes = dist_env.all_reduce_sum(votes, env)
    if not any(votes):
        return None
    names = (f"loss {loss.item()}" if not env.distributed else "loss", "gradient",
             "buffers (BatchNorm statistics)")
    return " and ".join(
        name + (f" on {int(v)} of {env.world_size} ranks" if env.distributed else "")
        for name, v in zip(names, votes) if v)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the duration of a file write, then deliver them.

    The writes are atomic anyway (temp file + rename), so an interrupt could never leave half a
    file; deferring it means Ctrl-C or torchrun's SIGTERM also does not throw away a checkpoint
    that was a moment from complete. Only the main thread can install handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(received):
            signal.raise_signal(s)


def _write_text(path: Path, text: str) -> None:
    """Write a small run-directory file atomically: a kill leaves the old file or the new one."""
    def write(f: Any) -> None:
        f.write(text.encode())

    with _signals_deferred():
        ckpt._atomic_write(path, write)


# -- output ------------------------------------------------------------------------------------

def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip().splitlines())


def _summary(row: dict[str, Any], total_epochs: int) -> str:
    quality = (f"test_ppl {row['test_ppl']:.1f}" if "test_ppl" in row
               else f"test_acc {100 * row['test_acc']:.2f}%")
    return (f"epoch {row['epoch']}/{total_epochs} | train_loss {row['train_loss']:.4f} | {quality} | "
            f"params {row['params'] / 1e6:.2f}M | MACs {row['macs'] / 1e6:.1f}M | "
            f"{'low-rank' if row['lowrank'] else 'full-rank'} | {row['epoch_time']:.1f}s "
            f"(compute {row['compute_time']:.1f}s) | {row['comm_bytes_per_step'] / 1e6:.2f} MB/step")
