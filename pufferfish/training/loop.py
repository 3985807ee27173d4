"""The one training loop, whatever the task (images or language) and the method.

Full-rank, Pufferfish, low-rank-from-the-start and the pruning baselines differ only in the
:class:`~pufferfish.training.methods.Method` the loop is given; the comm hook is a config value.
The loop knows nothing of low rank: at each epoch start it asks the method, and when the method
has changed the model it rebuilds what depends on the parameters (optimizer, DDP wrapper, comm
hook) through the same function that built them at the start. Reading order: :func:`train`,
:func:`_train` (set-up, resume, the epochs), :func:`_train_epoch`, :func:`_step` (the one
:func:`~pufferfish.training.step.train_step` with this run's options), :func:`_checkpoint`.

Resume: every stateful part of a run saves and loads its own state, and a checkpoint holds them
by name (:func:`_components`): the method, the model, the optimizer, the AMP scaler and the run's
progress once, and each rank's comm-hook state, epoch meter and task state in ``"ranks"``.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from tqdm import tqdm

from ..config import ConfigError, TrainConfig, dump_toml
from ..data import DataError
from ..distributed import env as dist_env
from ..distributed import fsdp
from ..distributed.buckets import BucketTuner
from ..distributed.diloco import DiLoCoState
from ..distributed.env import DistEnv
from ..distributed.hooks import hook_options, register_comm_hook
from ..distributed.replicas import replica_mesh
from . import checkpoint as ckpt
from . import faults, optim, startup, tasks
from .methods import Change, Method, build_method
from .metrics import EvalLog, MetricsWriter, quality_key
from .schedule import lr_at
from .step import EpochMeter, Replica, train_step
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
class Progress:
    """Where the run is; also what the RNG is at, as every draw is a function of it."""

    epoch: int = 0
    step_in_epoch: int = 0  # steps of ``epoch`` already taken
    global_step: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]


@dataclass
class Run(Replica):
    """What the loop mutates as it goes: the replica being trained, and where it is."""

    progress: Progress = field(default_factory=Progress)
    meter: EpochMeter = field(default_factory=EpochMeter)
    figures: dict[str, Any] | None = None  # the method's model figures, until the next change
    sync: DiLoCoState | None = None  # --sync diloco: outer optimizer and synchronized weights
    mesh: DeviceMesh | None = None  # fsdp + diloco: ("replicate", "shard"), distributed/replicas.py
    last_checkpoint: Path | None = None
    buckets: BucketTuner = field(default_factory=BucketTuner)  # DDP's bucket cap, and its trials
    change: Change | None = None  # the last change of the model, whose report has the buckets
    noted: int = 0  # bucket decisions reported so far


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
    if not env.distributed and cfg.comm != "allreduce":
        # One process has no gradient all-reduce to compress: training would silently run
        # without the hook the user asked for.
        raise ConfigError(f"comm {cfg.comm!r} is invalid without a process group: allowed "
                          "'allreduce', or launch under torchrun (--nproc-per-node 1 works)")
    if not env.distributed and cfg.sync != "ddp":
        raise ConfigError(f"sync {cfg.sync!r} is invalid without a process group: allowed 'ddp', "
                          "or launch under torchrun (--nproc-per-node 1 works)")
    if not env.distributed and cfg.parallel == "fsdp":
        raise ConfigError("parallel 'fsdp' is invalid without a process group: allowed 'ddp', or "
                          "launch under torchrun (--nproc-per-node 1 works)")
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
    if not cfg.out:  # a fresh directory: rank 0's name (clocks can tick between ranks)
        run_dir = Path(dist_env.broadcast_object(str(run_dir), env))
        cfg = dataclasses.replace(cfg, out=str(run_dir))
        dist_env.say(env, f"run directory: {run_dir} (--out to choose it)")
    if cfg.mode == "pufferfish" and cfg.warmup_epochs.endswith("%"):
        dist_env.say(env, f"warm-up: {cfg.warmup_epochs} of {cfg.epochs} epochs = "
                          f"{cfg.switch_epoch} full-rank epochs before the switch")
    # Before anything is written or loaded: rank 0 decides what happens to the run directory
    # (resume, start, or refuse) and every rank learns it.
    resumed = startup.find_resume_point(cfg, env, run_dir,
                                        (*tasks.run_fields(cfg), *optim.RUN_FIELDS, *method.run_fields,
                                         *SYNC_FIELDS))
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    task = build_task(cfg, env)
    model = task.model.to(env.device)
    method.setup(model, task.example_input(env.device), cfg)
    writer = MetricsWriter(run_dir, enabled=env.is_main)
    evals = EvalLog(run_dir, enabled=env.is_main)
    startup.check_agree(env, "the data or the checkpoint to resume", {
        **startup.data_fingerprint(task),
        "resume_from": None if resumed is None else resumed[1].name}, DataError)
    buckets = BucketTuner(cfg.bucket_mb)
    mesh = _replica_mesh(cfg, env)
    if resumed is None:
        buckets.start(model, "start", len(task.train_loader), _ddp(cfg, env))
        run = _prepare(cfg, model, env, method, buckets, mesh)
    else:
        run = _resume(cfg, env, method, task, model, *resumed, buckets, mesh)
        with _signals_deferred():  # rows of the epoch being redone go
            writer.truncate(run.progress.epoch)
            evals.truncate(run.progress.global_step)
    _write_config(cfg, env, run_dir)
    if cfg.compile:
        # In place (the same module, the same state_dict keys): DDP calls the compiled forward,
        # and the modules a switch swaps in fail dynamo's guards once: one recompilation.
        run.model.compile(backend=cfg.compile_backend)

    total = method.total_epochs(cfg)
    while run.progress.epoch < total:
        epoch = run.progress.epoch
        if run.progress.step_in_epoch == 0:
            _start_epoch(cfg, env, run, method, task, run_dir)
        row = _train_epoch(cfg, env, run, method, task, run_dir, evals)
        row.update(task.evaluate(run.model, env))
        if run.figures is None:  # recounted only when the method changed the model
            with _eager():
                run.figures = method.model_figures(run.model, task.example_input(env.device))
        row.update(run.figures)
        row.update(method.on_epoch_end(epoch, run.model))
        with _signals_deferred():
            writer.write(row)
        dist_env.say(env, _summary(row, total))
        run.progress.epoch, run.progress.step_in_epoch = epoch + 1, 0
        every = cfg.checkpoint_every_epochs  # 0: only the last epoch's
        if epoch + 1 == total or (every and (epoch + 1) % every == 0):
            _checkpoint(cfg, env, run, method, task, run_dir)
        _note_buckets(env, run, run_dir)
    if env.is_main:
        dist_env.say(env, writer.final_table())
    return writer.rows


# -- set-up and resume -------------------------------------------------------------------------

# What a resume may not change about the synchronization (the checkpoint's layout depends on it).
SYNC_FIELDS = ("sync", "inner_steps", "outer_lr", "outer_momentum")


def _replica_mesh(cfg: TrainConfig, env: DistEnv) -> DeviceMesh | None:
    """fsdp + diloco: the processes as replicas x shards (distributed/replicas.py); else None."""
    if cfg.parallel != "fsdp" or cfg.sync != "diloco":
        return None
    try:
        return replica_mesh(cfg.shard_size, env.device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _prepare(cfg: TrainConfig, model: nn.Module, env: DistEnv, method: Method,
             buckets: BucketTuner, mesh: DeviceMesh | None = None) -> Run:
    """Optimizer, DDP wrapper (with ``buckets.cap``; none under DiLoCo), comm hook and AMP scaler
    for the model as it is now.

    First the memory format: with ``channels_last`` every 4-D weight (convolutions) is stored
    NHWC, which the CPU (oneDNN) and GPU convolution kernels run faster, the small factorized
    convolutions most (docs/benchmarks.md). Here, because this runs before every DDP wrap, so
    modules a method swapped in are converted too; the parameters stay the same objects.
    """
    if cfg.channels_last and cfg.parallel == "ddp":  # FSDP2 shards contiguous parameters only
        model.to(memory_format=torch.channels_last)
    if cfg.parallel == "fsdp":  # over mesh["shard"] under DiLoCo: one replica per group
        wrapped = fsdp.shard(model, fsdp.mixed_precision(env.device, cfg.amp),
                             mesh=None if mesh is None else mesh["shard"])
    # DiLoCo: no DDP wrapper, each worker (each FSDP2 group) steps alone until the outer step
    # (_after_step); bound after sharding, so it holds each process's local shards.
    sync = (DiLoCoState(cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum,
                        None if mesh is None else mesh.get_group("replicate"),
                        buffer_group=None).bind(model)  # buffers: over every process
            if cfg.sync == "diloco" else None)
    if cfg.parallel == "ddp":
        wrapped = model if sync is not None else dist_env.wrap_ddp(model, env, buckets.cap)
    # After wrapping: FSDP2 replaces the parameters by their shards (DTensors).
    optimizer = method.build_optimizer(model, cfg)
    scaler = (torch.amp.GradScaler("cuda") if cfg.amp and env.device.type == "cuda" else None)
    if scaler is not None and cfg.comm == "signum":
        # GradScaler divides the reduced gradient by the loss scale; signum's +-1 votes
        # never carried it, so every step would shrink by the scale (2**16 at first).
        raise ConfigError("comm 'signum' is invalid with amp on CUDA (its +-1 votes ignore the "
                          "loss scale): allowed without --amp, or another comm")
    return Run(model=model, wrapped=wrapped, optimizer=optimizer, scaler=scaler, sync=sync,
               hook_state=None if sync is not None else _register_hook(cfg, wrapped, env),
               buckets=buckets, mesh=mesh)


def _register_hook(cfg: TrainConfig, wrapped: nn.Module, env: DistEnv) -> Any:
    if not env.distributed or cfg.parallel == "fsdp":  # comm hooks are DDP's
        return None

    return register_comm_hook(wrapped, cfg.comm, **hook_options(cfg.comm, cfg))


def _components(run: Run, method: Method, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's stateful parts by checkpoint key: shared by all ranks (rank 0's saved), and
    each rank's own (saved by every rank). Each has ``state_dict``/``load_state_dict``."""
    shared = {"method": method, "model": run.model, "optimizer": run.optimizer,
              "scaler": run.scaler, "progress": run.progress, "buckets": run.buckets}
    per_rank = {"hook": run.hook_state, "meter": run.meter, "task": task}
    if run.sync is not None:  # DiLoCo: each worker's inner optimizer state is its own
        shared["sync"] = run.sync
        per_rank["optimizer"] = shared.pop("optimizer")
    return shared, per_rank


def _resume(cfg: TrainConfig, env: DistEnv, method: Method, task: Task, model: nn.Module,
            saved: dict[str, Any], path: Path, buckets: BucketTuner,
            mesh: DeviceMesh | None = None) -> Run:
    """The run as the checkpoint ``saved`` left it: the architecture, weights and bucket cap
    first (the optimizer and DDP are built on them), then every other component from its entry."""
    method.load_state_dict(saved["method"], model)  # e.g. rebuild the factorized architecture
    written = "fsdp" if "sharded" in saved else "ddp"
    if written != cfg.parallel:
        raise ckpt.CheckpointError(f"checkpoint {path} was written with --parallel {written}: "
                                   f"resume it with --parallel {written}")
    if written == "ddp":
        startup.load_model(model, saved["model"], path)
    buckets.load_state_dict(saved.get("buckets") or {"cap_mib": None, "decisions": []})
    run = _prepare(cfg, model, env, method, buckets, mesh)
    run.noted = len(buckets.decisions)
    shared, per_rank = _components(run, method, task)
    del shared["method"], shared["model"], shared["buckets"]  # loaded above (or below, sharded)
    if written == "fsdp":  # each rank reads its own shards, resharded by DCP if need be
        _check_replicas(run, saved, path)
        state = _sharded_state(run)
        ckpt.load_sharded(path, saved["sharded"], state)
        _load_sharded_state(run, state)
        shared.pop("optimizer", None), per_rank.pop("optimizer", None)
    ranks = saved.get("ranks") or []
    mine = ranks[env.rank] if env.rank < len(ranks) else {}
    for components, states in ((shared, saved), (per_rank, mine)):
        for name, component in components.items():
            if component is not None and states.get(name):  # e.g. no scaler on CPU
                component.load_state_dict(states[name])
    run.last_checkpoint = path
    dist_env.say(env, f"resumed from {path} at epoch {run.progress.epoch}, "
                      f"step {run.progress.step_in_epoch}")
    return run


def _sharded_state(run: Run) -> dict[str, Any]:
    """The DCP state: model and optimizer shards; under DiLoCo the inner optimizer under its
    replica's key (replicas differ between outer steps) and the outer state (the same on all)."""
    state = fsdp.sharded_state(run.model, run.optimizer)
    if run.sync is not None:
        replica = 0 if run.mesh is None else run.mesh.get_local_rank("replicate")
        state["optimizer"] = {f"replica{replica}": state["optimizer"]}
        state["sync"] = run.sync.sharded_state_dict()
    return state


def _load_sharded_state(run: Run, state: dict[str, Any]) -> None:
    """Put :func:`_sharded_state`, filled by a DCP load, back into the run."""
    if run.sync is not None:
        (optimizer,) = state["optimizer"].values()
        fsdp.load_sharded_state(run.model, run.optimizer, {**state, "optimizer": optimizer})
        run.sync.load_sharded_state_dict(state["sync"])
    else:
        fsdp.load_sharded_state(run.model, run.optimizer, state)


def _check_replicas(run: Run, saved: dict[str, Any], path: Path) -> None:
    """fsdp + diloco: each replica's inner optimizer is its own, so the grid must not change."""
    was, now = saved.get("replicas"), None if run.mesh is None else run.mesh.size(0)
    if was != now:
        raise ckpt.CheckpointError(
            f"checkpoint {path} was written by {was or 1} DiLoCo replica(s) over FSDP2, this run "
            f"has {now or 1}: resume it with the same number of processes and --shard-size")


def _write_config(cfg: TrainConfig, env: DistEnv, run_dir: Path) -> None:
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


def _start_epoch(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
                 run_dir: Path) -> None:
    """Before an epoch's first step: the method's change of the model, if any, then a fresh
    optimizer (its state reset unless the method carries some over), DDP wrapper and comm hook
    for the changed parameters."""
    task.start_epoch(run.progress.epoch)
    before = dict(run.model.named_parameters(remove_duplicate=False))
    with _eager():
        change = method.on_epoch_start(run.progress.epoch, run.model)
    if change is not None:
        _rebuild(cfg, env, run, method, task, change, before, run_dir)


def _rebuild(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
             change: Change, before: dict[str, torch.Tensor], run_dir: Path) -> None:
    """After the method changed the model (``before``: its parameters until then): buckets
    chosen again for the new model, a fresh optimizer, DDP wrapper and comm hook, with what
    state the method carries over."""
    run.buckets.start(run.model, f"after the {change.name} at epoch {run.progress.epoch}",
                      len(task.train_loader), _ddp(cfg, env))  # a new model: new buckets
    fresh = _prepare(cfg, run.model, env, method, run.buckets, run.mesh)
    if run.hook_state is not None and fresh.hook_state is not None:
        fresh.hook_state.stats = run.hook_state.stats  # the epoch's byte counts go on (mid-epoch)
    method.carry_state(run.optimizer, fresh.optimizer, before, run.model)
    if run.sync is not None and fresh.sync is not None:  # changed at an outer-step boundary
        method.carry_outer_state(run.sync.optimizer, fresh.sync.optimizer, before, run.model)
        fresh.sync.outer_steps = run.sync.outer_steps
        fresh.sync.stats = run.sync.stats  # the epoch's byte counts go on (a switch mid-epoch)
    run.optimizer, run.wrapped, run.hook_state = fresh.optimizer, fresh.wrapped, fresh.hook_state
    run.sync = fresh.sync
    run.figures, run.change = None, change
    dist_env.say(env, change.text)
    _record_change(env, run, run_dir)


def _record_change(env: DistEnv, run: Run, run_dir: Path) -> None:
    """The last change's report, with the bucket choices so far (``buckets``), and
    ``buckets.json``."""
    if not env.is_main:
        return
    decisions = run.buckets.decisions
    _write_text(run_dir / "buckets.json", json.dumps(decisions, indent=1))
    if run.change is not None:
        change = run.change
        text = change.text + ("\n" + run.buckets.describe() if decisions else "")
        _write_text(run_dir / f"{change.name}.txt", text + "\n")
        _write_text(run_dir / f"{change.name}.json", json.dumps(
            {**change.record, "buckets": decisions}, indent=1, default=str))


def _note_buckets(env: DistEnv, run: Run, run_dir: Path) -> None:
    """Report the bucket decisions made since the last report (a trial ended)."""
    if len(run.buckets.decisions) == run.noted:
        return
    for line in run.buckets.describe().splitlines()[run.noted:]:
        dist_env.say(env, line)
    run.noted = len(run.buckets.decisions)
    _record_change(env, run, run_dir)


# -- one epoch, one step -----------------------------------------------------------------------

def _train_epoch(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
                 run_dir: Path, evals: EvalLog) -> dict[str, Any]:
    """The epoch's remaining steps (all of them, unless resumed mid-epoch); its metrics row."""
    loader, progress = task.train_loader, run.progress
    loader.set_epoch(progress.epoch)
    steps = len(loader)
    run.wrapped.train()
    stats = _comm_stats(run)
    if stats is not None:
        stats.reset()
    bar = _progress_bar(cfg, env, progress, steps)
    run.meter.start()
    for i, batch in enumerate(loader):
        if i < progress.step_in_epoch:  # resuming mid-epoch: these steps were taken before
            continue
        before = dict(run.model.named_parameters(remove_duplicate=False))
        with _eager():
            change = method.on_step_start(progress.epoch, i, steps, run.model)
        if change is not None:  # a switch in steps (warmup_steps), mid-epoch
            _rebuild(cfg, env, run, method, task, change, before, run_dir)
        run.meter.batch_ready()
        lr = lr_at(cfg, method.schedule_step(progress.global_step, steps), steps)
        with run.buckets.step(run):  # during a bucket trial: timed, perhaps re-wrapped
            loss, bad = _step(cfg, env, run, method, task, batch, i, lr)
        progress.global_step += 1
        progress.step_in_epoch = i + 1
        _after_step(run, steps)
        method.on_step_end(progress.epoch, i + 1, steps, run.model)
        run.meter.step_done(loss, applied=bad is None)
        bar.update(1)
        if env.is_main and i % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.3g}")
        if cfg.eval_every_steps and progress.global_step % cfg.eval_every_steps == 0 \
                and progress.step_in_epoch < steps:  # the epoch's end evaluates anyway
            _evaluate_within_epoch(env, run, task, evals)
        if cfg.checkpoint_every_steps and progress.global_step % cfg.checkpoint_every_steps == 0 \
                and progress.step_in_epoch < steps:
            _checkpoint(cfg, env, run, method, task, run_dir)
    bar.close()
    return _epoch_row(cfg, env, run, method, steps)


def _evaluate_within_epoch(env: DistEnv, run: Run, task: Task, evals: EvalLog) -> None:
    """``--eval-every-steps``: the task's evaluation now, printed and kept in ``evals.jsonl``."""
    row = {"epoch": run.progress.epoch + 1, "step": run.progress.global_step,
           **task.evaluate(run.model, env)}
    with _signals_deferred():
        evals.write(row)
    dist_env.say(env, " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in row.items()))


def _step(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task, batch: Any,
          i: int, lr: float) -> tuple[torch.Tensor, str | None]:
    """Step ``i`` of the epoch: seeded, at learning rate ``lr``, its non-finite policy applied."""
    progress = run.progress
    faults.strike("step", progress.global_step, env.rank)  # tests and benchmarks/faults.sh
    torch.manual_seed(_step_seed(cfg.seed, progress.epoch, i, env.rank))
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = task.to_device(batch, env.device)

    def compute_loss() -> torch.Tensor:
        loss = task.loss(run.wrapped, batch)
        extra = method.extra_loss(run.model)
        return loss if extra is None else loss + extra

    def vote(loss: torch.Tensor) -> str | None:
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        return _nonfinite_votes(loss, grads if run.scaler is None else [],
                                list(run.model.buffers()), env)

    # Skipping a step must also undo what the forward pass itself changed: BatchNorm running
    # statistics (a NaN batch would poison them for good) and the task's carried state.
    undo = _snapshot(run.model, task) if cfg.nonfinite == "skip" else None
    loss, bad = train_step(run, compute_loss, autocast=_autocast(cfg, env),
                           grad_clip=cfg.grad_clip, vote=vote, undo=undo)
    if bad is not None and cfg.nonfinite == "stop":
        raise TrainingError(
            f"non-finite {bad} at epoch {progress.epoch}, step {i} (global step "
            f"{progress.global_step}); last good checkpoint: {run.last_checkpoint or 'none'}; "
            "lower --lr, set --grad-clip, or use --nonfinite skip")
    return loss, bad


def _ddp(cfg: TrainConfig, env: DistEnv) -> bool:
    """Whether the model is wrapped in DDP (a process group, not FSDP2, no DiLoCo)."""
    return env.distributed and cfg.parallel == "ddp" and cfg.sync == "ddp"


def _tokens_per_example(cfg: TrainConfig) -> int:
    """Tokens in one example of a batch: a sequence for the LMs (llama packs ``seq_len``)."""
    if not cfg.is_lm:
        return 1
    return cfg.seq_len if cfg.model == "llama" else cfg.bptt


def _after_step(run: Run, steps: int) -> None:
    """After an optimizer step, the synchronization's own work: DiLoCo's outer step every
    ``inner_steps`` steps and at the epoch's end (evaluation, checkpoints and the method's
    changes then see identical replicas). DDP synchronized inside the step."""
    if run.sync is not None:
        run.sync.inner_step_done(run.progress.global_step,
                                 end_of_epoch=run.progress.step_in_epoch == steps)


def _comm_stats(run: Run) -> Any:
    """Whoever counts this run's bytes: the comm hook (DDP), DiLoCo's state, or none."""
    owner = run.sync if run.sync is not None else run.hook_state
    return None if owner is None else owner.stats


def _epoch_row(cfg: TrainConfig, env: DistEnv, run: Run, method: Method,
               steps: int) -> dict[str, Any]:
    """The epoch's metrics: its mean loss over all ranks, times, and the comm hook's counts."""
    counts = run.meter.finish()
    total_loss, total_steps = dist_env.all_reduce_sum([counts["loss_sum"], counts["n_steps"]], env)
    counter = _comm_stats(run)
    stats = counter.snapshot() if counter is not None else {}
    last = run.progress.global_step - 1
    per_step = stats.get("bytes_sent", 0.0) / max(1, counts["local_steps"])
    row = {
        "epoch": run.progress.epoch + 1,
        # Mean over the steps that were applied (NaN if every step of the epoch was skipped).
        "train_loss": total_loss / total_steps if total_steps else float("nan"),
        "skipped_steps": counts["skipped_steps"],
        "steps": counts["n_steps"] + counts["skipped_steps"],  # optimizer steps of the epoch
        "lr": lr_at(cfg, method.schedule_step(last, steps), steps),
        "epoch_time": counts["epoch_time"],
        "compute_time": counts["compute_time"],
        "data_time": counts["data_time"],
        # Per step this process took: after a mid-epoch resume the stats cover only those.
        # DiLoCo: its outer steps' bytes spread over all optimizer steps, so methods compare.
        "comm_bytes_per_step": per_step,
        "comm_bytes_per_sample": per_step / (cfg.batch_size * _tokens_per_example(cfg)),
        "compress_time": stats.get("compress_time", 0.0),
        "comm_time": stats.get("comm_time", 0.0),
        # FSDP2: all-gather + reduce-scatter bytes and sharded memory (docs/benchmarks.md)
        **(fsdp.step_figures(run.model, run.optimizer,
                             env.world_size if run.mesh is None else run.mesh.size(1))
           if cfg.parallel == "fsdp" else {}),
    }
    if run.mesh is not None:  # fsdp + diloco: every byte per step, inside and across replicas
        row["outer_bytes_per_step"] = per_step
        row["comm_bytes_per_step"] += per_step
        row["comm_bytes_per_sample"] = row["comm_bytes_per_step"] / (
            cfg.batch_size * _tokens_per_example(cfg))
    if run.sync is not None:
        row["outer_steps"] = run.sync.outer_steps  # of the run so far
        row["comm_bytes_per_outer_step"] = (stats.get("bytes_sent", 0.0)
                                            / max(1, stats.get("buckets", 0)))
    return row


def _progress_bar(cfg: TrainConfig, env: DistEnv, progress: Progress, steps: int) -> Any:
    return tqdm(total=steps, initial=progress.step_in_epoch,
                desc=f"epoch {progress.epoch + 1}/{cfg.epochs}",
                disable=not (env.is_main and cfg.progress), leave=False, mininterval=1.0)


def _eager() -> contextlib.AbstractContextManager:
    """Outside the training step the model runs eagerly under ``--compile``: the switch and the
    figures run it under torch's flop counter, and dynamo skips a frame it met under a dispatch
    mode for good (measured: no recompilation after the switch, the rest of the run eager)."""
    return torch.compiler.set_stance("force_eager")


def _autocast(cfg: TrainConfig, env: DistEnv) -> contextlib.AbstractContextManager:
    if not cfg.amp:
        return contextlib.nullcontext()
    if env.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 100_003 + step * 101 + rank) % (2**63)


# -- checkpoints -------------------------------------------------------------------------------

def _checkpoint(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
                run_dir: Path) -> None:
    """Rank 0 writes every component's state (:func:`_components`); every rank learns whether
    it worked.

    Per-rank states are all-gathered so one file resumes every rank exactly. The outcome is
    broadcast instead of a bare barrier, so a failed write (disk full, permissions) stops every
    rank at once with rank 0's message, not rank 0 alone while the others wait out the timeout.
    """
    progress = run.progress
    finite = _all_finite([*run.model.state_dict().values(), *_tensors(run.optimizer.state)])
    if dist_env.all_reduce_sum([0.0 if finite else 1.0], env)[0]:
        # The steps' losses and gradients were finite but the update overflowed the weights.
        raise TrainingError(
            f"non-finite parameters or optimizer state after epoch {progress.epoch}, step "
            f"{progress.step_in_epoch} (global step {progress.global_step}): not saved; last "
            f"good checkpoint: {run.last_checkpoint or 'none'}; lower --lr or set --grad-clip")
    run.buckets.settle(run)  # a checkpoint holds a bucket choice, never half a trial
    shared, per_rank = _components(run, method, task)
    sharded = {}
    if cfg.parallel == "fsdp":  # model and optimizer: every rank writes its shards (DCP)
        with _signals_deferred():
            sharded = {"sharded": ckpt.save_sharded(run_dir, progress.global_step,
                                                    _sharded_state(run), env.is_main)}
        del shared["model"]
        shared.pop("optimizer", None), per_rank.pop("optimizer", None)
        if run.mesh is not None:
            sharded["replicas"] = run.mesh.size(0)
    ranks = dist_env.gather_object(_states(per_rank), env)
    written = error = None
    if env.is_main:
        payload = {"config": cfg.to_dict(), "world_size": env.world_size, **_states(shared),
                   "ranks": ranks, **sharded}
        try:
            with _signals_deferred():  # Ctrl-C / SIGTERM wait for the write (or its cleanup)
                written = str(ckpt.save_checkpoint(run_dir, payload, progress.global_step,
                                                   keep_last=cfg.keep_checkpoints))
        except ckpt.CheckpointError as e:
            error = str(e)
    # Also the barrier: nobody runs ahead of a checkpoint that is still being written.
    written, error = dist_env.broadcast_object((written, error), env)
    if error is not None:
        raise ckpt.CheckpointError(error if env.is_main else f"rank 0 failed: {error}")
    run.last_checkpoint = Path(written)  # every rank can name the last good checkpoint


def _states(components: dict[str, Any]) -> dict[str, Any]:
    """Each component's ``state_dict()`` by name (None for a component this run has not)."""
    return {name: None if c is None else c.state_dict() for name, c in components.items()}


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (the optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


# -- failures, signals and files ---------------------------------------------------------------

_PEER_FAILURE = re.compile(r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe|"
                           r"[Ss]ocket|peer|[Gg]loo|NCCL|[Ww]atchdog")


def _is_peer_failure(e: BaseException) -> bool:
    """A failure of the process group (peer gone or frozen), not of this process's work."""

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
    carried = task.state_dict()

    def restore() -> None:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        task.load_state_dict(carried)

    return restore


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is finite; the max-abs norm is exact (a 2-norm of huge but finite
    values overflows to inf) and propagates NaN."""
    tensors = [fsdp.local(t) for t in tensors if t.is_floating_point()]  # a shard: voted per rank
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
    with _signals_deferred():
        ckpt.atomic_write_text(path, text)


# -- output ------------------------------------------------------------------------------------

def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip().splitlines())


def _summary(row: dict[str, Any], total_epochs: int) -> str:
    key = quality_key(row)
    quality = f"{key} {row[key]:.1f}" if key != "test_acc" else f"test_acc {100 * row[key]:.2f}%"
    if "tokens_per_s" in row:
        quality += f" | {row['tokens_per_s']:.0f} tok/s"
    size = f"params {row['params'] / 1e6:.2f}M | "
    if "macs" in row:  # the model figures of the method (FullRankMethod's and its subclasses')
        size += f"MACs {row['macs'] / 1e6:.1f}M | "
    if "lowrank" in row:
        size += f"{'low-rank' if row['lowrank'] else 'full-rank'} | "
    return (f"epoch {row['epoch']}/{total_epochs} | train_loss {row['train_loss']:.4f} | "
            f"{quality} | {size}{row['epoch_time']:.1f}s (compute {row['compute_time']:.1f}s) | "
            f"{row['comm_bytes_per_step'] / 1e6:.2f} MB/step")
