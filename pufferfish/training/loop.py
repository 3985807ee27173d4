"""The one training loop, whatever the task (images or language) and the method.

Full-rank, Pufferfish, low-rank-from-the-start and the pruning baselines differ only in the
:class:`~pufferfish.training.methods.Method` the loop is given; the comm hook is a config value.
The loop knows nothing of low rank: at each epoch start it asks the method, and when the method
has changed the model it rebuilds what depends on the parameters (optimizer, DDP wrapper, comm
hook) through the same function that built them at the start
(:mod:`~pufferfish.training.build`). Reading order: :func:`train`, :func:`_train` (set-up,
resume), :func:`_epochs`, :func:`_train_epoch`, :func:`_step` (the one
:func:`~pufferfish.training.step.train_step` with this run's options).

Steps are optimizer steps: with ``--grad-accum N`` each is N micro-batches of ``--batch-size``
(an epoch's last incomplete group dropped), and everything counted in steps (the switch at
``warmup_steps``, the LR schedule, ``eval_every_steps``, ``checkpoint_every_steps``, DiLoCo's
inner steps, bytes per step) counts those.

Resume: every stateful part of a run saves and loads its own state, and a checkpoint holds them
by name (:func:`~pufferfish.training.build.components`, written by
:func:`~pufferfish.training.build.checkpoint`): the method, the model, the optimizer,
the AMP scaler and the run's progress once, and each rank's comm-hook state, epoch meter and task
state in ``"ranks"``.

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
import functools
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, TrainConfig
from ..data import DataError
from ..distributed import env as dist_env
from ..distributed import fsdp
from ..distributed.buckets import BucketTuner
from ..distributed.env import DistEnv
from ..outputs import OutputsError, make_fresh
from . import checkpoint as ckpt
from . import faults, optim, startup, tasks
from .board import open_board, summary_writer
from .budget import resolve_token_budget
from .build import (
    SYNC_FIELDS,
    checkpoint,
    ddp,
    note_buckets,
    prepare,
    rebuild,
    replica_mesh,
    resume,
    write_config,
)
from .guards import (
    Interrupted,
    PeerError,
    TrainingError,
    gloo_text,
    is_peer_failure,
    nonfinite_votes,
    signals_deferred,
    snapshot,
)
from .methods import Method, build_method
from .metrics import MetricsWriter, quality_key, selection_key
from .precision import autocast, check_amp
from .progressbar import run_bar
from .run import Run
from .schedule import lr_at
from .step import micro_batch_groups, train_step
from .tasks import Task, build_task, steps_per_epoch

__all__ = ["PeerError", "TrainingError", "train"]


def train(cfg: TrainConfig, method: Method | None = None) -> list[dict[str, Any]]:
    """Run one training job as configured; returns the metrics rows (one per epoch).

    ``method`` defaults to the one registered for ``cfg.mode``. In a process group, a failure of
    the group itself (a peer crashed, froze, or never came) is raised as :class:`PeerError`.
    The group is gone when this returns (drained first) or raises (not drained: end the process
    with :func:`pufferfish.distributed.env.exit_process`, as ``python -m pufferfish`` does).
    """
    try:
        env = dist_env.setup(cfg.backend, cfg.timeout_s)
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        raise PeerError(f"could not form the process group of {os.environ.get('WORLD_SIZE')} "
                        f"processes within --timeout-s {cfg.timeout_s:g}: {gloo_text(e)}") from e
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
        cfg = resolve_token_budget(cfg, env)  # --tokens-per-param: epochs and train_subset
        method = method if method is not None else build_method(cfg)
        rows = _train(cfg, env, method)
        finished = True
        return rows
    except RuntimeError as e:
        if not env.distributed or isinstance(e, TrainingError | ckpt.CheckpointError) \
                or not is_peer_failure(e):
            raise
        raise PeerError(f"rank {env.rank} lost contact with the other processes ({gloo_text(e)}); "
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
    check_amp(cfg, env)  # a CPU without the model's bf16 kernels refuses --amp, on every rank
    if cfg.logger == "tensorboard":
        summary_writer()  # the package is there: else refused on every rank, nothing written
    created = False
    if not cfg.out:  # a fresh directory: rank 0's (clocks can tick between ranks)
        run_dir, created = _fresh_run_dir(env, run_dir), env.is_main
        cfg = dataclasses.replace(cfg, out=str(run_dir))
        dist_env.say(env, f"run directory: {run_dir} (--out to choose it)")
    try:
        with contextlib.ExitStack() as hold:  # rank 0's lock on the run directory
            return _run(cfg, env, method, run_dir, hold, created)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise Interrupted(_how_to_continue(env, run_dir)) from e


def _fresh_run_dir(env: DistEnv, name: Path) -> Path:
    """The default run directory, made by rank 0 with one atomic mkdir (:func:`make_fresh`) and
    broadcast; under torchrun the launch's own name, the same for its restarts."""
    made: Any = None
    if env.is_main:
        try:
            made = str(name if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none"
                       else make_fresh(name))
        except OutputsError as e:  # as the run's other bad input: one line, exit 2
            made = ConfigError(str(e))
        except (ConfigError, OSError) as e:
            made = e
    made = dist_env.broadcast_object(made, env)
    if isinstance(made, BaseException):
        raise made
    return Path(made)


def _how_to_continue(env: DistEnv, run_dir: Path) -> str:
    """What Ctrl-C says: the command that continues the run, or that there is nothing yet."""
    again = " (under torchrun, as before)" if env.distributed else ""
    if ckpt.checkpoint_files(run_dir):
        return f"continue with: pufferfish train --resume {run_dir}{again}"
    return (f"no checkpoint in {run_dir} yet: start it again with the same command and "
            f"--out {run_dir} --overwrite{again}")


def _run(cfg: TrainConfig, env: DistEnv, method: Method, run_dir: Path,
         hold: contextlib.ExitStack, created: bool) -> list[dict[str, Any]]:
    """The run in ``run_dir``: resume point, components, the epochs, the final table."""
    resumed = startup.find_resume_point(
        cfg, env, run_dir, (*tasks.run_fields(cfg), *optim.RUN_FIELDS, *method.run_fields,
                            *SYNC_FIELDS),
        hold=hold, total_epochs=method.total_epochs(cfg), created=created)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    task = build_task(cfg, env)
    steps = steps_per_epoch(cfg, task)  # optimizer steps; refuses a --grad-accum beyond the data
    method.check_steps(steps)  # a switch the run's steps cannot hold: refused, nothing written
    text = method.start_text(steps) if resumed is None else None  # a resumed run is past it
    if text:
        dist_env.say(env, text)
    model = task.model.to(env.device)
    method.setup(model, task.example_input(env.device), cfg)
    startup.check_agree(env, "the data or the checkpoint to resume", {
        **startup.data_fingerprint(task),
        "resume_from": None if resumed is None else resumed[1].name}, DataError)
    buckets = BucketTuner(cfg.bucket_mb)
    mesh = replica_mesh(cfg, env)
    if resumed is None:
        buckets.start(model, "start", steps, ddp(cfg, env))
        run = prepare(cfg, model, env, method, buckets, mesh)
    else:
        run = resume(cfg, env, method, task, model, *resumed, buckets, mesh)
    # The board's events from the next step on, left by a crashed attempt, are hidden (purged).
    writer = MetricsWriter(run_dir, env.is_main, open_board(cfg.logger, run_dir, env.is_main,
                                                            run.progress.global_step + 1))
    if resumed is not None:
        with signals_deferred():  # rows of the epoch being redone go
            writer.truncate(run.progress.epoch)
            writer.evals.truncate(run.progress.global_step)
    write_config(cfg, env, run_dir)
    if cfg.compile:
        # In place (the same module, the same state_dict keys): DDP calls the compiled forward,
        # and the modules a switch swaps in fail dynamo's guards once: one recompilation.
        run.model.compile(backend=cfg.compile_backend)
    try:
        _epochs(cfg, env, run, method, task, run_dir, writer)
    finally:
        writer.close()
    if env.is_main:
        dist_env.say(env, writer.final_table())
        dist_env.say(env, _headline(writer.rows, run_dir))
    return writer.rows


def _epochs(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task, run_dir: Path,
            writer: MetricsWriter) -> None:
    """The epochs that remain: each trained, evaluated, recorded and checkpointed."""
    total = method.total_epochs(cfg)
    run.bar = run_bar(cfg, env, run.progress.global_step, steps_per_epoch(cfg, task), total)
    try:
        while run.progress.epoch < total:
            _run_epoch(cfg, env, run, method, task, run_dir, writer, total)
    finally:
        run.bar.close()


def _run_epoch(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
               run_dir: Path, writer: MetricsWriter, total: int) -> None:
    """One epoch of ``total``: trained, evaluated, recorded and checkpointed."""
    epoch = run.progress.epoch
    run.bar.set_description(f"epoch {epoch + 1}/{total}")
    if run.progress.step_in_epoch == 0:
        _start_epoch(cfg, env, run, method, task, run_dir, writer)
    row = _train_epoch(cfg, env, run, method, task, run_dir, writer)
    _fit_batchnorm(cfg, env, run, task)
    run.bar.set_description(f"epoch {epoch + 1}/{total} evaluating")
    row.update(task.evaluate(run.model, env))
    if epoch + 1 == total:  # the reported figures (the LM's test split), after the last epoch
        row.update(task.final_metrics(run.model, env))
    if run.figures is None:  # recounted only when the method changed the model
        with _eager():
            run.figures = method.model_figures(run.model, task.example_input(env.device))
    row.update(run.figures)
    row.update(method.on_epoch_end(epoch, run.model))
    with signals_deferred():
        writer.write(row, run.progress.global_step)
    dist_env.say(env, _summary(row, total))
    run.progress.epoch, run.progress.step_in_epoch = epoch + 1, 0
    every = cfg.checkpoint_every_epochs  # 0: only the last epoch's
    if epoch + 1 == total or (every and (epoch + 1) % every == 0):
        checkpoint(cfg, env, run, method, task, run_dir)
    note_buckets(env, run, run_dir)


def _start_epoch(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
                 run_dir: Path, writer: MetricsWriter) -> None:
    """Before an epoch's first step: the method's change of the model, if any, then a fresh
    optimizer (its state reset unless the method carries some over), DDP wrapper and comm hook
    for the changed parameters."""
    task.start_epoch(run.progress.epoch)
    before = dict(run.model.named_parameters(remove_duplicate=False))
    with _eager():
        change = method.on_epoch_start(run.progress.epoch, run.model)
    if change is not None:
        rebuild(cfg, env, run, method, task, change, before, run_dir)
        writer.change(change.name, change.text, change.record, run.progress.global_step + 1)


# -- one epoch, one step -----------------------------------------------------------------------

def _train_epoch(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
                 run_dir: Path, writer: MetricsWriter) -> dict[str, Any]:
    """The epoch's remaining steps (all of them, unless resumed mid-epoch); its metrics row."""
    loader, progress = task.train_loader, run.progress
    loader.set_epoch(progress.epoch)
    steps = steps_per_epoch(cfg, task)
    run.wrapped.train()
    stats = _comm_stats(run)
    if stats is not None:
        stats.reset()
    bar = run.bar
    run.meter.start()
    for i, batches in enumerate(micro_batch_groups(loader, cfg.grad_accum)):
        if i < progress.step_in_epoch:  # resuming mid-epoch: these steps were taken before
            continue
        before = dict(run.model.named_parameters(remove_duplicate=False))
        with _eager():
            change = method.on_step_start(progress.epoch, i, steps, run.model)
        if change is not None:  # a switch in steps (warmup_steps), mid-epoch
            rebuild(cfg, env, run, method, task, change, before, run_dir)
            writer.change(change.name, change.text, change.record, progress.global_step + 1)
        run.meter.batch_ready()
        lr = lr_at(cfg, method.schedule_step(progress.global_step, steps), steps) \
            * method.lr_scale(progress.global_step, steps)
        sent = _bytes_sent(run)
        with run.buckets.step(run):  # during a bucket trial: timed, perhaps re-wrapped
            loss, bad = _step(cfg, env, run, method, task, batches, i, lr)
        progress.global_step += 1
        progress.step_in_epoch = i + 1
        _after_step(run, steps)
        method.on_step_end(progress.epoch, i + 1, steps, run.model)
        run.meter.step_done(loss, applied=bad is None)
        writer.step(progress.global_step, loss, lr, run.meter.last_step_time,
                    max(0.0, _bytes_sent(run) - sent))
        bar.update(1)
        if env.is_main and i % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.3g}")
        if cfg.eval_every_steps and progress.global_step % cfg.eval_every_steps == 0 \
                and progress.step_in_epoch < steps:  # the epoch's end evaluates anyway
            _evaluate_within_epoch(cfg, env, run, task, writer)
        if cfg.checkpoint_every_steps and progress.global_step % cfg.checkpoint_every_steps == 0 \
                and progress.step_in_epoch < steps:
            _fit_batchnorm(cfg, env, run, task)
            checkpoint(cfg, env, run, method, task, run_dir)
    return _epoch_row(cfg, env, run, method, steps)


def _evaluate_within_epoch(cfg: TrainConfig, env: DistEnv, run: Run, task: Task,
                           writer: MetricsWriter) -> None:
    """``--eval-every-steps``: the task's evaluation now, printed and kept in ``evals.jsonl``."""
    _fit_batchnorm(cfg, env, run, task)
    row = {"epoch": run.progress.epoch + 1, "step": run.progress.global_step,
           **task.evaluate(run.model, env)}
    with signals_deferred():
        writer.evals.write(row)
    dist_env.say(env, " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in row.items()))


def _step(cfg: TrainConfig, env: DistEnv, run: Run, method: Method, task: Task,
          batches: list[Any], i: int, lr: float) -> tuple[torch.Tensor, str | None]:
    """Step ``i`` of the epoch on its micro-batches: seeded, at learning rate ``lr``, its
    non-finite policy applied."""
    progress = run.progress
    faults.strike("step", progress.global_step, env.rank)  # tests and benchmarks/faults.sh
    torch.manual_seed(_step_seed(cfg.seed, progress.epoch, i, env.rank))
    for group in run.optimizer.param_groups:
        group["lr"] = lr

    def compute_loss(batch: Any) -> torch.Tensor:
        loss = task.loss(run.wrapped, task.to_device(batch, env.device))
        extra = method.extra_loss(run.model)
        return loss if extra is None else loss + extra

    def vote(loss: torch.Tensor) -> str | None:
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        return nonfinite_votes(loss, grads if run.scaler is None else [],
                               list(run.model.buffers()), env)

    # Skipping a step must also undo what the forward pass itself changed: BatchNorm running
    # statistics (a NaN batch would poison them for good) and the task's carried state.
    undo = snapshot(run.model, task) if cfg.nonfinite == "skip" else None
    losses = [functools.partial(compute_loss, batch) for batch in batches]
    loss, bad = train_step(run, losses, autocast=autocast(cfg, env),
                           grad_clip=cfg.grad_clip, vote=vote, undo=undo)
    if bad is not None and cfg.nonfinite == "stop":
        raise TrainingError(
            f"non-finite {bad} at epoch {progress.epoch}, step {i} (global step "
            f"{progress.global_step}); last good checkpoint: {run.last_checkpoint or 'none'}; "
            "lower --lr, set --grad-clip, or use --nonfinite skip")
    return loss, bad


def _samples_per_step(cfg: TrainConfig) -> int:
    """Images or tokens one process trains on per optimizer step: ``grad_accum`` micro-batches
    of ``batch_size`` examples, each a sequence for the LMs (llama packs ``seq_len`` tokens)."""
    return cfg.batch_size * cfg.grad_accum * tasks.tokens_per_sample(cfg)


def _after_step(run: Run, steps: int) -> None:
    """After an optimizer step, the synchronization's own work: DiLoCo's outer step every
    ``inner_steps`` steps and at the epoch's end (evaluation, checkpoints and the method's
    changes then see identical replicas). DDP synchronized inside the step."""
    if run.sync is not None:
        run.sync.inner_step_done(run.progress.global_step,
                                 end_of_epoch=run.progress.step_in_epoch == steps)


def _fit_batchnorm(cfg: TrainConfig, env: DistEnv, run: Run, task: Task) -> None:
    """DiLoCo, before the model is evaluated or saved: BatchNorm statistics recomputed for the
    synchronized weights on the epoch's first ``bn_batches`` training batches (the replicas'
    average does not fit them: distributed/diloco.py). Between outer steps each replica keeps
    its own."""
    if run.sync is None or not cfg.bn_batches:
        return

    def batches() -> Iterator[Any]:  # lazy; a fresh pass: the epoch's order, training's untouched
        yield from itertools.islice(task.train_loader, cfg.bn_batches)

    def forward(batch: Any) -> None:
        with autocast(cfg, env):
            task.loss(run.wrapped, task.to_device(batch, env.device))

    with _eager():
        run.sync.recompute_batchnorm(batches(), forward)


def _comm_stats(run: Run) -> Any:
    """Whoever counts this run's bytes: the comm hook (DDP), DiLoCo's state, or none."""
    owner = run.sync if run.sync is not None else run.hook_state
    return None if owner is None else owner.stats


def _bytes_sent(run: Run) -> float:
    """The bytes this process has sent so far this epoch (the counts reset at its start)."""
    stats = _comm_stats(run)
    return 0.0 if stats is None else float(stats.snapshot().get("bytes_sent", 0.0))


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
        "lr": lr_at(cfg, method.schedule_step(last, steps), steps) * method.lr_scale(last, steps),
        "epoch_time": counts["epoch_time"],
        "compute_time": counts["compute_time"],
        "data_time": counts["data_time"],
        # Per step this process took: after a mid-epoch resume the stats cover only those.
        # DiLoCo: its outer steps' bytes spread over all optimizer steps, so methods compare.
        "comm_bytes_per_step": per_step,
        "comm_bytes_per_sample": per_step / _samples_per_step(cfg),
        "compress_time": stats.get("compress_time", 0.0),
        # FSDP2: all-gather + reduce-scatter bytes and sharded memory (docs/benchmarks.md)
        **(fsdp.step_figures(run.model, run.optimizer,
                             env.world_size if run.mesh is None else run.mesh.size(1),
                             cfg.grad_accum)
           if cfg.parallel == "fsdp" else {}),
    }
    if run.mesh is not None:  # fsdp + diloco: every byte per step, inside and across replicas
        row["outer_bytes_per_step"] = per_step
        row["comm_bytes_per_step"] += per_step
        row["comm_bytes_per_sample"] = row["comm_bytes_per_step"] / _samples_per_step(cfg)
    if run.sync is not None:
        row["outer_steps"] = run.sync.outer_steps  # of the run so far
        row["comm_bytes_per_outer_step"] = (stats.get("bytes_sent", 0.0)
                                            / max(1, stats.get("buckets", 0)))
    return row


def _eager() -> contextlib.AbstractContextManager:
    """Outside the training step the model runs eagerly under ``--compile``: the switch and the
    figures run it under torch's flop counter, and dynamo skips a frame it met under a dispatch
    mode for good (measured: no recompilation after the switch, the rest of the run eager)."""
    return torch.compiler.set_stance("force_eager")


def _step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 100_003 + step * 101 + rank) % (2**63)


# -- output ------------------------------------------------------------------------------------

def _headline(rows: list[dict[str, Any]], run_dir: Path) -> str:
    """The run's last line: its result and where everything is."""
    if not rows:
        return f"run directory: {run_dir}"
    row = rows[-1]
    figures = ", ".join(f"{key} {100 * row[key]:.2f}%" if key.endswith("_acc") else
                        f"{key} {row[key]:.2f}"
                        for key in dict.fromkeys((quality_key(row), selection_key(row))))
    return (f"done: {figures} after {row['epoch']} epoch{'s' * (row['epoch'] != 1)}, "
            f"{row['params'] / 1e6:.2f}M parameters; run directory: {run_dir} (metrics.jsonl, "
            "checkpoints/; `pufferfish report` compares runs)")


def _summary(row: dict[str, Any], total_epochs: int) -> str:
    quality = " | ".join(f"{key} {100 * row[key]:.2f}%" if key.endswith("_acc") else
                         f"{key} {row[key]:.1f}"
                         for key in dict.fromkeys((selection_key(row), quality_key(row))))
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
