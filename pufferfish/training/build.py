"""A run's components: built at the start, rebuilt after the method changed the model, resumed.

:func:`prepare` builds what depends on the parameters (optimizer, DDP wrapper or FSDP2 shards,
DiLoCo's state, comm hook, AMP scaler) for the model as it is now; :func:`rebuild` calls it again
after a change, carrying over what state the method keeps; :func:`checkpoint` saves every
component's state (:func:`components`) and :func:`resume` calls :func:`prepare` on the
checkpoint's architecture and then loads every component from its entry.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ConfigError, TrainConfig
from ..configfile import dump_toml
from ..distributed import env as dist_env
from ..distributed import fsdp, replicas
from ..distributed.buckets import BucketTuner
from ..distributed.diloco import DiLoCoState
from ..distributed.env import DistEnv
from ..distributed.hooks import hook_options, register_comm_hook
from ..models.memory_format import to_channels_last
from . import checkpoint as ckpt
from . import startup
from .checkpoint.ranks import save_from_ranks
from .guards import TrainingError, all_finite, write_text
from .methods import Change, Method
from .run import Run
from .rundir import record_run
from .tasks import Task, steps_per_epoch

# What a resume may not change about the synchronization (the checkpoint's layout depends on it).
SYNC_FIELDS = ("sync", "inner_steps", "outer_lr", "outer_momentum")


def replica_mesh(cfg: TrainConfig, env: DistEnv) -> DeviceMesh | None:
    """fsdp + diloco: the processes as replicas x shards (distributed/replicas.py); else None."""
    if cfg.parallel != "fsdp" or cfg.sync != "diloco":
        return None
    try:
        return replicas.replica_mesh(cfg.shard_size, env.device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare(cfg: TrainConfig, model: nn.Module, env: DistEnv, method: Method,
            buckets: BucketTuner, mesh: DeviceMesh | None = None) -> Run:
    """Optimizer, DDP wrapper (with ``buckets.cap``; none under DiLoCo), comm hook and AMP scaler
    for the model as it is now.

    First the memory format: with ``channels_last`` every 4-D weight (convolutions) is stored
    NHWC, which the CPU (oneDNN) and GPU convolution kernels run faster, the small factorized
    convolutions most (docs/benchmarks.md). Here, because this runs before every DDP wrap, so
    modules a method swapped in are converted too; the parameters stay the same objects.
    """
    if cfg.channels_last and cfg.parallel == "ddp":  # FSDP2 shards contiguous parameters only
        to_channels_last(model)  # but strided 1x1 convs with few channels: oneDNN#6035
    if cfg.parallel == "fsdp":  # over mesh["shard"] under DiLoCo: one replica per group
        wrapped = fsdp.shard(model, fsdp.mixed_precision(env.device, cfg.amp, model),
                             mesh=None if mesh is None else mesh["shard"])
    # DiLoCo: no DDP wrapper, each worker (each FSDP2 group) steps alone until the outer step
    # (loop._after_step); bound after sharding, so it holds each process's local shards.
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


def components(run: Run, method: Method, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's stateful parts by checkpoint key: shared by all ranks (rank 0's saved), and
    each rank's own (saved by every rank). Each has ``state_dict``/``load_state_dict``."""
    shared = {"method": method, "model": run.model, "optimizer": run.optimizer,
              "scaler": run.scaler, "progress": run.progress, "buckets": run.buckets}
    per_rank = {"hook": run.hook_state, "meter": run.meter, "task": task}
    if run.sync is not None:  # DiLoCo: each worker's inner optimizer state is its own
        shared["sync"] = run.sync
        per_rank["optimizer"] = shared.pop("optimizer")
    return shared, per_rank


def checkpoint(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
               run_dir: Path) -> None:
    """Every component's state (:func:`components`), checked finite on every rank, saved as one
    checkpoint by :func:`~pufferfish.training.checkpoint.ranks.save_from_ranks`; a non-finite
    state is a :class:`TrainingError` on every rank and nothing is written."""
    progress = run.progress
    finite = all_finite([*run.model.state_dict().values(), *_tensors(run.optimizer.state)])
    if dist_env.all_reduce_sum([0.0 if finite else 1.0], env)[0]:
        # The steps' losses and gradients were finite but the update overflowed the weights.
        raise TrainingError(
            f"non-finite parameters or optimizer state after epoch {progress.epoch}, step "
            f"{progress.step_in_epoch} (global step {progress.global_step}): not saved; last "
            f"good checkpoint: {run.last_checkpoint or 'none'}; lower --lr or set --grad-clip")
    run.buckets.settle(run)  # a checkpoint holds a bucket choice, never half a trial
    shared, per_rank = components(run, method, task)
    fsdp2 = cfg.parallel == "fsdp"
    run.last_checkpoint = save_from_ranks(
        env, run_dir, progress.global_step,
        {"config": cfg.to_dict(), "world_size": env.world_size}, shared, per_rank,
        keep_last=cfg.keep_checkpoints,
        sharded_state=(lambda: sharded_state(run)) if fsdp2 else None,
        replicas=run.mesh.size(0) if fsdp2 and run.mesh is not None else None)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (the optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def resume(cfg: TrainConfig, env: DistEnv, method: Method, task: Task, model: nn.Module,
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
    run = prepare(cfg, model, env, method, buckets, mesh)
    run.noted = len(buckets.decisions)
    shared, per_rank = components(run, method, task)
    del shared["method"], shared["model"], shared["buckets"]  # loaded above (or below, sharded)
    if written == "fsdp":  # each rank reads its own shards, resharded by DCP if need be
        _check_replicas(run, saved, path)
        state = sharded_state(run)
        ckpt.load_sharded(path, saved["sharded"], state)
        _load_sharded_state(run, state)
        shared.pop("optimizer", None), per_rank.pop("optimizer", None)
    ranks = saved.get("ranks") or []
    mine = ranks[env.rank] if env.rank < len(ranks) else {}
    for parts, states in ((shared, saved), (per_rank, mine)):
        for name, component in parts.items():
            if component is not None and states.get(name):  # e.g. no scaler on CPU
                component.load_state_dict(states[name])
    run.last_checkpoint = path
    dist_env.say(env, f"resumed from {path} at epoch {run.progress.epoch}, "
                      f"step {run.progress.step_in_epoch}")
    return run


def sharded_state(run: Run) -> dict[str, Any]:
    """The DCP state: model and optimizer shards; under DiLoCo the inner optimizer under its
    replica's key (replicas differ between outer steps) and the outer state (the same on all)."""
    state = fsdp.sharded_state(run.model, run.optimizer)
    if run.sync is not None:
        replica = 0 if run.mesh is None else run.mesh.get_local_rank("replicate")
        state["optimizer"] = {f"replica{replica}": state["optimizer"]}
        state["sync"] = run.sync.sharded_state_dict()
    return state


def _load_sharded_state(run: Run, state: dict[str, Any]) -> None:
    """Put :func:`sharded_state`, filled by a DCP load, back into the run."""
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


def write_config(cfg: TrainConfig, env: DistEnv, run_dir: Path) -> None:
    if env.is_main:
        # The effective configuration, also on resume (flags may have changed, e.g. --epochs), so
        # that a later --resume continues this run as it is now; without the resume request, and
        # without --overwrite (a later fork from this run must not inherit it).
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text(run_dir / "config.toml",
                   dump_toml(dataclasses.replace(cfg, resume="", overwrite=False)))
    # The whole configuration only under --verbose: ~90 lines would bury the warnings above it
    # (a rejected checkpoint, say); config.toml holds it.
    if cfg.verbose:
        dist_env.say(env, "configuration:\n" + _indent(dump_toml(cfg)))
    dist_env.say(env, f"{cfg.model} (width {cfg.width:g}) on {cfg.data}, mode {cfg.mode}, "
                      f"{cfg.epochs} epochs: {env.world_size} process(es), backend "
                      f"{env.backend or 'none'}, device {env.device}, comm {cfg.comm}")
    dist_env.say(env, f"configuration: {run_dir / 'config.toml'}"
                      + ("" if cfg.verbose else " (--verbose prints it)"))


def rebuild(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
            change: Change, before: dict[str, torch.Tensor], run_dir: Path) -> None:
    """After the method changed the model (``before``: its parameters until then): buckets
    chosen again for the new model, a fresh optimizer, DDP wrapper and comm hook, with what
    state the method carries over."""
    run.buckets.start(run.model, f"after the {change.name} at epoch {run.progress.epoch}",
                      steps_per_epoch(cfg, task), ddp(cfg, env))  # a new model: new buckets
    fresh = prepare(cfg, run.model, env, method, run.buckets, run.mesh)
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
    write_text(run_dir / "buckets.json", json.dumps(decisions, indent=1))
    if run.change is not None:
        change = run.change
        record_run(run_dir, [f"{change.name}.txt", f"{change.name}.json"])
        text = change.text + ("\n" + run.buckets.describe() if decisions else "")
        write_text(run_dir / f"{change.name}.txt", text + "\n")
        write_text(run_dir / f"{change.name}.json", json.dumps(
            {**change.record, "buckets": decisions}, indent=1, default=str))


def note_buckets(env: DistEnv, run: Run, run_dir: Path) -> None:
    """Report the bucket decisions made since the last report (a trial ended)."""
    if len(run.buckets.decisions) == run.noted:
        return
    for line in run.buckets.describe().splitlines()[run.noted:]:
        dist_env.say(env, line)
    run.noted = len(run.buckets.decisions)
    _record_change(env, run, run_dir)


def ddp(cfg: TrainConfig, env: DistEnv) -> bool:
    """Whether the model is wrapped in DDP (a process group, not FSDP2, no DiLoCo)."""
    return env.distributed and cfg.parallel == "ddp" and cfg.sync == "ddp"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.strip().splitlines())

