"""Worker of ``pufferfish bench``: time DDP training steps of some methods on one link.

Started once per rank by :mod:`pufferfish.bench.runner` (through
:func:`pufferfish.bench.workers.run_workers`, which sets ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` and, on an emulated link, runs us inside a network
namespace). The ``--methods`` are measured one after the other in the order given, each
with a fresh model, DDP wrapper, hook and optimizer but the same minibatches (a method with its
own settings, ``powersgd:rank=2``, runs with them over the flags: :mod:`.methods`); one worker
group per link and round thus interleaves the methods without paying process start-up per
method. After each method rank 0 rewrites ``--out`` with the JSON list of the records so
far; the runner reads it (a group that fails later keeps the methods it finished).

What is measured, per rank and method, after ``--warmup`` full steps (DDP re-buckets after
its first step and PowerSGD starts compressing at step ``--powersgd-start-iter``, so
warm-up must cover both):

Every step is the training loop's own step function
(:func:`pufferfish.training.step.train_step`: forward, zero_grad, backward, optimizer step;
no AMP, clipping or non-finite vote, which would add a collective), with the workload's one
optimizer for every method (:func:`~pufferfish.bench.workload.make_optimizer`: AdamW for the
language models, GaLore its own AdamW; SGD with momentum for the image models). With
``--grad-accum N`` a step is N micro-batches of ``--batch-size`` and one gradient synchronization
(DDP's ``no_sync`` for the first N - 1, FSDP2's gradient sync off): times, bytes and collectives
are per optimizer step.

Buckets (``--bucket-mb``): a fixed cap, torch's default, or (``auto``) each method's own
fastest, chosen before the warm-up by the training loop's trial
(:class:`~pufferfish.distributed.buckets.BucketTuner`, on extra steps of this method), so that
every method is compared with its best buckets; the record says which (``bucket_mib``).

``compute_time``
    Median of ``--compute-steps`` steps run under ``ddp.no_sync()``: the same work with
    no gradient communication at all.
    The model and optimizer are restored after each, so the replicas do not drift.
``step_time``
    Median of ``--steps`` full DDP steps with the method's comm hook, each started
    after a barrier (in training the previous step's all-reduce aligns the ranks).
    Compute-only and full steps alternate, so both see the same load on a shared machine.
    A hook's encode and decode are inside it: DDP's backward returns only once every
    bucket's future has completed, and PowerSGD's last callback is its decode (``M ~ P Q^T``;
    on gloo each compressed bucket is even finished inside the hook), so PowerSGD's three
    all-reduces per bucket and all its compression work are timed
    (``tests/test_bench_links.py`` checks the hook's work is done when the step returns).
``comm_time``
    ``step_time - compute_time``: the communication (including the hook's encode/decode)
    that overlap with backward did NOT hide. It is what a faster network can save.
DiLoCo methods (``diloco``, ``pufferfish+diloco``) have no DDP: ``compute_time`` is the median
of plain local steps, and each timed "full step" is one outer step (the all-reduce of the
pseudo-gradients, after a barrier) amortized over ``--inner-steps``: ``step_time`` = compute +
outer step / H, and ``bytes_per_step`` / ``collectives_per_step`` are the outer step's / H.
FSDP2 methods (``fsdp``, ``pufferfish+fsdp``) have no DDP either: :mod:`pufferfish.bench.sharded`
times them (compute on an unsharded local copy, full steps sharded).

``compress_time`` / ``hook_time``, ``bytes_per_step`` / ``ring_bytes_per_step``
    The hook's :class:`~pufferfish.distributed.hooks.CommStats` per step (median times,
    mean bytes). ``bytes_per_step`` is the payload this rank hands to collectives;
    ``ring_bytes_per_step`` what it sends under the ring model.

Ranks agree on everything but the timings; the record takes the slowest rank's medians
(a synchronous step cannot beat the slowest rank's compute) and keeps every rank's.

All communication goes through the hook: DDP is built with ``broadcast_buffers=False``
(otherwise it broadcasts BatchNorm statistics in every forward, even under ``no_sync``,
which would put an uncounted collective into ``compute_time``). Batches are real
Fashion-MNIST minibatches (language models: KJV word sequences of ``--seq-len`` tokens, words
past id ``--vocab`` - 1 as one id), prepared before timing so data loading is never
timed. ``galore`` is full-rank DDP with GaLore's optimizer (:mod:`pufferfish.baselines.galore`) on the layers
Pufferfish factorizes; ``--compile`` compiles every method's model (warm-up steps include it).

Device (:func:`join`): with ``--device auto`` each rank runs on a GPU when CUDA is there (local
rank ``r`` on GPU ``r mod count``), with NCCL when every rank of the job has its own GPU and gloo
when ranks share one (NCCL refuses two ranks on one device); a group with an FSDP2 method runs on the CPU
(its records say so: ``device``). Every timed step is wrapped in ``torch.cuda.synchronize()``
(:func:`pufferfish.training.step.timed`), so its time is the GPU's work, not the launches;
warm-up steps are never timed. ``--amp bf16|fp16`` runs the
forward under autocast (fp16 with a GradScaler, whose state the compute-only steps restore too).
On CUDA the hook's ``compress_time`` is host time around its launches (a lower bound); the
exposed communication (``comm_time``) is still step - compute-only step, both synchronized.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import itertools
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..data import (
    DEFAULT_FASHION_DIR,
    NORMALIZATION,
    TensorImageLoader,
    load_dataset,
    load_fashion_mnist,
)
from ..distributed.buckets import BucketTuner, bucket_overrides, parse_bucket_mb
from ..distributed.diloco import DiLoCoState
from ..distributed.env import cleanup, exit_process, join_group, local_ranks, pick_device
from ..distributed.hooks import hook_options, register_comm_hook
from ..models import get_spec
from ..training.step import Replica, micro_batch_groups, timed, to_device
from .methods import (  # the methods' one home; step.py measures them
    BENCH_METHODS,
    DILOCO_METHODS,
    FSDP_METHODS,
    HOOK_DEFAULTS,
    HOOK_OPTIONS,
    MethodSpec,
    base_of,
    hook_for,
    parallel_for,
)
from .sharded import measure_sharded
from .usermodel import FIND_UNUSED_ATTR, is_user_model, user_batches
from .workload import (
    PUFFERFISH_RANK_RATIO,
    build_model,
    make_optimizer,
    quartiles,
    train_one_step,
)

__all__ = ["PUFFERFISH_RANK_RATIO", "amp_for", "cpu_name", "device_facts", "join",
           "machine_facts", "main", "method_options", "rank_device"]

# No BatchNorm-statistics broadcast in forward (see the module docstring); newer torch
# renamed the flag and warns about the old one.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def method_options(hook: str, args: argparse.Namespace) -> dict[str, Any]:
    """Hyperparameters of ``hook`` from the command line (the hooks' own names)."""
    return hook_options(hook, args)


def amp_for(amp: str, device: torch.device) -> tuple[Any, Any]:
    """``(autocast context or None, GradScaler or None)`` of ``--amp`` on ``device``: bf16
    autocast, or fp16 autocast with a GradScaler; ``none``: full precision."""
    if amp == "none":
        return None, None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    return torch.autocast(device.type, dtype=dtype), scaler


def _method_list(text: str) -> list[str]:
    """``--methods`` as canonical names (settings allowed: ``powersgd:rank=2``)."""
    try:
        methods = [MethodSpec.parse(m).name for m in text.split(",") if m.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not methods:
        raise argparse.ArgumentTypeError("no method given")
    return methods


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pufferfish.bench.step", description=__doc__)
    ap.add_argument("--methods", required=True, type=_method_list,
                    help="comma-separated, measured in this order; from "
                    + ", ".join(BENCH_METHODS))
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compute-steps", type=int, default=5)
    for option in HOOK_OPTIONS:
        ap.add_argument("--" + option.key.replace("_", "-"), type=option.kind,
                        default=HOOK_DEFAULTS.get(option.key, option.default))
    ap.add_argument("--inner-steps", type=int, default=50, help="DiLoCo methods: steps per sync")
    ap.add_argument("--rank-ratio", type=float, default=None,
                    help="factorized methods' rank ratio (default: 0.25, a Workload's own)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--cache-dir", default=None, help="decoded-tensor cache shared by workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
    ap.add_argument("--device", default="auto", help="auto (CUDA when there), cpu or cuda")
    ap.add_argument("--seq-len", type=int, default=64, help="language models: tokens a sequence")
    ap.add_argument("--vocab", type=int, default=2000, help="language models: vocabulary size")
    ap.add_argument("--bucket-mb", type=parse_bucket_mb, default="torch")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return ap


def _steps_batches(args: argparse.Namespace, rank: int, world: int, n: int,
                   device: torch.device) -> list[Any]:
    """The micro-batches of ``n`` steps, ``--grad-accum`` per step: one list per step, on
    ``device`` before any step is timed."""
    micro = [to_device(b, device) for b in _batches(args, rank, world, n * args.grad_accum)]
    return list(micro_batch_groups(micro, args.grad_accum))


def _batches(args: argparse.Namespace, rank: int, world: int, n: int) -> list[Any]:
    """``n`` real training minibatches of this rank's shard, materialized up front."""
    if is_user_model(args.model):  # the user's Workload.make_batch
        return user_batches(args.model, args.seq_len, args.batch_size, n, seed=args.seed + rank)
    if get_spec(args.model).is_lm:
        return _token_batches(args, rank, world, n)

    images, labels = load_fashion_mnist(
        args.data_dir or DEFAULT_FASHION_DIR, "train", cache_dir=args.cache_dir
    )
    mean, std = NORMALIZATION["fashion-mnist"]
    loader = TensorImageLoader(
        images, labels, args.batch_size, mean=mean, std=std, shuffle=True, augment=True,
        crop_padding=2, seed=args.seed, rank=rank, world_size=world, drop_last=True,
    )  # fmt: skip
    out: list[Any] = []
    epoch = 0
    while len(out) < n:
        loader.set_epoch(epoch)
        out.extend(batch for _, batch in zip(range(n - len(out)), loader))
        epoch += 1
    return out


def _token_batches(args: argparse.Namespace, rank: int, world: int, n: int) -> list[Any]:
    """``n`` (input, target) batches of KJV words (batch first, or sequence first where the
    model spec says so: the LSTM's)."""
    stream = load_dataset("kjv").train.clamp(max=args.vocab - 1)
    span = args.seq_len + 1
    count = n * args.batch_size
    starts = (torch.arange(count) * world + rank) * span % max(1, len(stream) - span)
    rows = torch.stack([stream[s:s + span] for s in starts.tolist()])
    batch_first = get_spec(args.model).batch_first
    out = []
    for chunk in rows.split(args.batch_size):
        x, y = chunk[:, :-1], chunk[:, 1:]
        out.append((x, y) if batch_first else (x.t().contiguous(), y.t().contiguous()))
    return out


def measure(args: argparse.Namespace, method: str, minibatches: list[Any],
            device: torch.device | None = None) -> dict[str, Any]:
    """Run the protocol of the module docstring for ``method`` on this rank, on
    ``minibatches`` (warm-up + compute-only + full steps of them, each a step's
    ``--grad-accum`` micro-batches, already on ``device``); return its measurements."""

    rank = dist.get_rank()
    device = device or torch.device("cpu")
    spec = MethodSpec.parse(method)
    args = spec.applied(args)  # the variant's own settings over the global flags
    factorized, hook = spec.factorized, spec.hook
    if spec.base in DILOCO_METHODS:
        return _measure_diloco(args, method, minibatches, device)
    if spec.base in FSDP_METHODS:
        return measure_sharded(args, method, factorized, minibatches)
    model, full_params = build_model(args, factorized)
    model.to(device)
    tuner = BucketTuner(args.bucket_mb)
    cap = tuner.start(model, method, steps_per_epoch=sys.maxsize)
    ddp = DistributedDataParallel(model, **_NO_BUFFER_SYNC, **bucket_overrides(cap),
                                  device_ids=[device.index] if device.type == "cuda" else None,
                                  find_unused_parameters=getattr(model, FIND_UNUSED_ATTR, False))
    state = register_comm_hook(ddp, hook, **method_options(hook, args))
    opt = make_optimizer(args, method, model)
    autocast, scaler = amp_for(args.amp, device)
    replica = Replica(model, ddp, opt, scaler=scaler, hook_state=state, autocast=autocast)
    trial = itertools.cycle(minibatches)
    while tuner.trying:  # auto: this method's own buckets, on extra steps
        with tuner.step(replica):
            train_one_step(replica, next(trial))
    batches = iter(minibatches)
    for _ in range(args.warmup):
        train_one_step(replica, next(batches))
    compute, steps, stats = _interleaved_steps(args, replica, state, batches)
    chosen = tuner.cap
    torch_steps = _torch_buckets_steps(replica, tuner, itertools.cycle(minibatches), args.steps)

    def median_of(key: str) -> float:
        return statistics.median(s[key] for s in stats)

    def mean_of(key: str) -> float:
        return statistics.fmean(s[key] for s in stats)

    return {
        "rank": rank,
        "step_times": steps,
        "compute_times": compute,
        "step_time": statistics.median(steps),
        "torch_step_time": statistics.median(torch_steps) if torch_steps else None,
        "step_time_quartiles": quartiles(steps),
        "compute_time": statistics.median(compute),
        "compute_time_quartiles": quartiles(compute),
        "compress_time": median_of("compress_time"),
        "hook_time": median_of("hook_time"),
        "bytes_per_step": mean_of("bytes_sent"),
        "ring_bytes_per_step": mean_of("ring_bytes"),
        "dense_bytes_per_step": mean_of("dense_bytes"),
        "collectives_per_step": mean_of("comm_calls"),
        "params": sum(p.numel() for p in model.parameters()),
        "params_full": full_params,
        "factorized": factorized,
        "hook": hook,
        "bucket_mib": chosen,
        "bucket_trial_ms": tuner.decisions[-1].get("median_ms"),
        **device_facts(device),
        "amp": args.amp,
    }


def _cpu_copy(state: Any) -> Any:
    """``state`` (a state dict) with every tensor copied to the CPU: undoing a compute-only step
    takes no accelerator memory (a deep copy there took about 3x the parameters' with AdamW)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):  # an OrderedDict stays one, with the modules' versions
        out = type(state)((k, _cpu_copy(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = copy.deepcopy(state._metadata)
        return out
    if isinstance(state, list | tuple):
        items = [_cpu_copy(v) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)
    return copy.deepcopy(state)


def _interleaved_steps(args: argparse.Namespace, replica: Replica, state: Any, batches: Any,
                       ) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """The timed steps: compute-only and full ones alternate, so that both medians see the same
    machine load (other processes come and go on a shared machine). Their times, and the comm
    hook's statistics of each full step."""
    model, ddp, opt = replica.model, replica.wrapped, replica.optimizer
    compute: list[float] = []
    steps: list[float] = []
    stats: list[dict[str, float]] = []
    for i in range(max(args.steps, args.compute_steps)):
        if i < args.compute_steps:
            # The same step with DDP's gradient synchronization switched off; its local-only
            # update is undone so that the replicas stay identical.
            saved = _cpu_copy(model.state_dict()), _cpu_copy(opt.state_dict())
            scale = replica.scaler.state_dict() if replica.scaler is not None else None
            batch = next(batches)
            with ddp.no_sync():
                compute.append(timed(lambda b=batch: train_one_step(replica, b)))
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            if scale is not None:
                replica.scaler.load_state_dict(scale)
        if i < args.steps:
            # Ranks start each full step together, as the previous step's all-reduce would
            # have aligned them in training (a compute-only step does not).
            dist.barrier()
            batch = next(batches)
            state.stats.reset()
            steps.append(timed(lambda b=batch: train_one_step(replica, b)))
            stats.append(state.stats.snapshot())
    return compute, steps, stats


def _torch_buckets_steps(replica: Replica, tuner: BucketTuner, batches: Any,
                         n: int) -> list[float]:
    """``n`` full steps with torch's default buckets right after the timed ones (same group,
    seconds apart): the before/after pair of a method whose trial chose another cap."""
    if tuner.cap is None:
        return []
    tuner.rewrap(replica, None)
    train_one_step(replica, next(batches))  # DDP assigns the buckets in its first step
    out = []
    for _ in range(n):
        dist.barrier()
        batch = next(batches)
        out.append(timed(lambda b=batch: train_one_step(replica, b)))
    return out


def _measure_diloco(args: argparse.Namespace, method: str, minibatches: list[Any],
                    device: torch.device) -> dict[str, Any]:
    """:func:`measure` for a DiLoCo method (``args`` with its own settings applied): local steps,
    and outer steps over ``--inner-steps``."""
    factorized, hook = hook_for(method)
    model, full_params = build_model(args, factorized)
    model.to(device)
    state = DiLoCoState(args.inner_steps).bind(model)
    opt = make_optimizer(args, method, model)
    autocast, scaler = amp_for(args.amp, device)
    replica = Replica(model, model, opt, scaler=scaler, autocast=autocast)
    batches = iter(minibatches)
    for _ in range(args.warmup):
        train_one_step(replica, next(batches))
    state.sync()
    compute: list[float] = []
    syncs: list[float] = []
    stats: list[dict[str, float]] = []
    for i in range(max(args.steps, args.compute_steps)):
        if i < args.compute_steps:
            batch = next(batches)
            compute.append(timed(lambda b=batch: train_one_step(replica, b)))
        if i < args.steps:
            dist.barrier()  # ranks reach an outer step together after their inner steps
            state.stats.reset()
            syncs.append(timed(state.sync))
            stats.append(state.stats.snapshot())
    h = args.inner_steps
    local = statistics.median(compute)
    steps = [local + s / h for s in syncs]
    return {
        "rank": dist.get_rank(), "step_times": steps, "compute_times": compute,
        "step_time": statistics.median(steps), "step_time_quartiles": quartiles(steps),
        "compute_time": local, "compute_time_quartiles": quartiles(compute),
        "compress_time": 0.0, "hook_time": statistics.median(s["hook_time"] for s in stats) / h,
        "bytes_per_step": statistics.fmean(s["bytes_sent"] for s in stats) / h,
        "ring_bytes_per_step": statistics.fmean(s["ring_bytes"] for s in stats) / h,
        "dense_bytes_per_step": statistics.fmean(s["dense_bytes"] for s in stats) / h,
        "collectives_per_step": 1.0 / h, "outer_step_time": statistics.median(syncs),
        "inner_steps": h, "params": sum(p.numel() for p in model.parameters()),
        "params_full": full_params, "factorized": factorized, "hook": hook,
        "bucket_mib": None, "bucket_trial_ms": None,  # no DDP, so no buckets (as FSDP2's)
        **device_facts(device), "amp": args.amp,
    }


# What an FSDP2 record adds (bench/sharded.py): the two collectives' payloads and this process's
# sharded parameter, gradient and optimizer bytes.
SHARDED_COUNTS = ("all_gather_bytes_per_step", "reduce_scatter_bytes_per_step",
                  "shard_param_bytes", "shard_grad_bytes", "shard_optimizer_bytes")


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from every rank's measurements: the slowest rank's timings, rank 0's counts."""
    r0 = per_rank[0]
    step = max(r["step_time"] for r in per_rank)
    torch_steps = [r.get("torch_step_time") for r in per_rank]
    compute = max(r["compute_time"] for r in per_rank)
    return {
        "step_time": step,
        "compute_time": compute,
        "comm_time": max(0.0, step - compute),
        # torch's default buckets in the same group (None: the method's cap is torch's)
        "torch_step_time": max(torch_steps) if None not in torch_steps else None,
        "compress_time": max(r["compress_time"] for r in per_rank),
        "hook_time": max(r["hook_time"] for r in per_rank),
        **{
            k: r0[k]
            for k in (
                "bytes_per_step",
                "ring_bytes_per_step",
                "dense_bytes_per_step",
                "collectives_per_step",
                "params",
                "params_full",
                "factorized",
                "hook",
                "bucket_mib",
                "bucket_trial_ms",
            )
        },
        **{k: r0[k] for k in SHARDED_COUNTS if k in r0},  # FSDP2 methods only
        "device": r0.get("device", "cpu"), "device_name": r0.get("device_name", ""),
        "amp": r0.get("amp", "none"),
        **({"inner_steps": r0["inner_steps"],  # DiLoCo methods only: the slowest outer step
            "outer_step_time": max(r["outer_step_time"] for r in per_rank)}
           if "inner_steps" in r0 else {}),
        "per_rank": per_rank,
    }


def _record(args: argparse.Namespace, method: str, world: int,
            gathered: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "method": method,
        "parallel": parallel_for(method),
        "model": args.model,
        "width": args.width,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "workers": world,
        "steps": args.steps,
        "warmup": args.warmup,
        "compute_steps": args.compute_steps,
        "threads": torch.get_num_threads(),
        **combine(gathered),
    }


def device_facts(device: torch.device) -> dict[str, str]:
    """What a record says of where it ran: the device and its model's name (a GPU's, or the
    CPU's: CPUs differ several-fold in compute, which decides whether a step waits on the wire)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": str(device), "device_name": name}


def machine_facts() -> dict[str, str]:
    """This host's CPU and, where CUDA sees one, its GPU (where ``pufferfish train`` then runs):
    what a training record (``bench --train``) says of where it ran; a name unknown is left out."""
    facts = {"cpu": cpu_name()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return {kind: name for kind, name in facts.items() if name}


def cpu_name() -> str:
    """The CPU's model name: Linux's ``/proc/cpuinfo``, else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def rank_device(requested: str, cpu_only: bool) -> torch.device:
    """This process's device (:func:`~pufferfish.distributed.env.pick_device`, from
    ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``: the bench's own workers are the processes of this
    machine, as under torchrun); ``cpu_only``: the CPU (FSDP2 methods are timed on the CPU).
    The GPU is made the current device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = pick_device("cpu" if cpu_only else requested, local_ranks()[0], count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def join(requested: str, cpu_only: bool, timeout_s: float) -> torch.device:
    """:func:`rank_device`, then the job's process group (``RANK`` of ``WORLD_SIZE``), NCCL
    where every process has a GPU of its own, else gloo (:func:`~pufferfish.distributed.env.
    join_group`)."""
    device = rank_device(requested, cpu_only)
    join_group("auto", device, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s)
    return device


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = join(args.device, any(base_of(m) in FSDP_METHODS for m in args.methods), 600)
    finished = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        minibatches = _steps_batches(args, rank, world,
                                     args.warmup + args.compute_steps + args.steps, device)
        records: list[dict[str, Any]] = []
        for method in args.methods:
            mine = measure(args, method, minibatches, device)
            gc.collect()  # the previous method's model, DDP reducer and hook state go now
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                records.append(_record(args, method, world, gathered))
                tmp = Path(args.out + ".tmp")
                tmp.write_text(json.dumps(records, indent=1))
                tmp.replace(args.out)
        finished = True
    finally:
        # Drained teardown: without it, gloo threads still releasing the comm hook's callbacks
        # met the interpreter's shutdown and aborted a worker (SIGABRT) in 2 of 21 groups of one
        # benchmark run; see pufferfish.distributed.env.cleanup.
        cleanup(drain=finished)
    return 0


if __name__ == "__main__":
    exit_process(main())
