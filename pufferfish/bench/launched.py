"""``pufferfish bench`` under ``torchrun``: measured inside the processes torchrun launched.

On one machine the bench launches its own ranks (:mod:`.workers`) over loopback or an emulated
link. Under ``torchrun`` (any ``--nnodes`` / ``--nproc-per-node``, its rendezvous as the user set
it) the processes are already there, on the user's machines and network: every process runs the
same ``pufferfish bench`` command, joins one process group (NCCL on a GPU per local rank, else
gloo: :func:`~.step.join`), and

1. probes the link between the ranks with the all-reduces of ``_probe.measure`` (bus bandwidth of
   a large one, round trip of a one-float one): the links table's one row, ``torchrun``;
2. measures every method in ``--rounds`` interleaved rounds (:func:`.rounds.round_plan`: the order
   rotates), each method with :func:`.step.measure` in this same group, the slowest rank's times
   gathered as a worker group's are (:func:`.step.combine`);
3. hands rank 0 the records; it writes results.json / results.md / plots as every bench does.

No emulation and no launcher of our own: ``--bandwidth`` and ``--workers`` are refused there
(:func:`.flags.config_from_args`). A rank that fails raises; torchrun then stops the others.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.env import cleanup
from . import _probe
from .bandwidth import TORCHRUN_LINK, format_bps
from .methods import FSDP_METHODS, base_of
from .probe import ProbeResult, probe_result
from .rounds import round_plan
from .step import (  # the step worker's own protocol
    _parser,
    _record,
    _steps_batches,
    join,
    measure,
)

__all__ = ["TORCHRUN_LINK", "is_rank0", "launched_world", "measure_in_group",
           "torchrun_links", "under_torchrun"]

_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")
GROUP_TIMEOUT_S = 600.0


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its environment variables are all set)."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


def launched_world() -> tuple[int, int]:
    """``(WORLD_SIZE, LOCAL_WORLD_SIZE)`` of this torchrun job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def torchrun_links(bandwidth: str | None, workers: int | None,
                   from_results: str = "") -> tuple[list[str], int]:
    """The bench's links and workers under torchrun: its link, its processes. ``--bandwidth``,
    ``--workers`` or ``--from-results`` given there is refused (``ValueError``, one line)."""
    for flag, value, why in (
            ("--bandwidth", bandwidth, "the link is the one its processes have"),
            ("--workers", workers, "its processes are the workers: --nnodes x --nproc-per-node"),
            ("--from-results", from_results or None, "it measures; reuse results outside it")):
        if value is not None:
            raise ValueError(f"{flag} {value} is invalid under torchrun ({why}): allowed "
                             "without it, or outside torchrun")
    return [TORCHRUN_LINK], launched_world()[0]


def is_rank0() -> bool:
    """Rank 0 of the torchrun job writes the outputs and prints."""
    return os.environ.get("RANK", "0") == "0"


def measure_in_group(methods: Sequence[str], rounds: int, step_flags: Sequence[str],
                     probe_bytes: int, log: Callable[[str], None],
                     log_record: Callable[[str, int, dict[str, Any]], None]) -> dict[str, Any]:
    """Probe the link (``probe_bytes`` 0: not) and measure ``methods`` in ``rounds`` rounds in one
    process group of torchrun's processes. ``step_flags``: the step worker's flags (its parser), so
    that a method is measured exactly as in the bench's own worker groups. Every rank returns
    ``{"links", "order", "rounds", "skipped", "failures"}``; only rank 0's records are filled."""
    args = _parser().parse_args(list(step_flags))
    if args.threads > 0:  # cores // LOCAL_WORLD_SIZE (torchrun itself sets OMP_NUM_THREADS=1)
        torch.set_num_threads(args.threads)
    device = join(args.device, any(base_of(m) in FSDP_METHODS for m in methods), GROUP_TIMEOUT_S)
    finished = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        probed = _probe_link(probe_bytes, log, device) if probe_bytes else None
        link = {"bandwidth": TORCHRUN_LINK, "bandwidth_bps": None, "delay_ms": 0.0,
                "link_bps": probed.bus_bps if probed else None,
                "link_rtt_s": probed.latency_s if probed else None,
                "processes": world, "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1"))}
        batches = _steps_batches(args, rank, world, args.warmup + args.compute_steps + args.steps,
                                 device)
        order = round_plan([TORCHRUN_LINK], methods, rounds)
        records: list[dict[str, Any]] = []
        for r, plan in enumerate(order):
            log(f"round {r + 1}/{rounds}: {TORCHRUN_LINK}: {', '.join(plan[0][1])}")
            for method in plan[0][1]:
                mine = measure(args, method, batches, device)
                gc.collect()  # the previous method's model, DDP reducer and hook state go now
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, mine)
                if rank == 0:
                    rec = {"round": r, **link, **_record(args, method, world, gathered)}
                    records.append(rec)
                    log_record(TORCHRUN_LINK, r, rec)
        finished = True
    finally:
        cleanup(drain=finished)  # the process then ends with exit_process(status) in __main__
    return {"links": [link], "order": order, "rounds": records, "skipped": [], "failures": []}


def _probe_link(nbytes: int, log: Callable[[str], None],
                device: torch.device | None = None) -> ProbeResult:
    """The all-reduce probe of bench/probe.py, run in this group: what the link delivers."""
    mine = _probe.measure(nbytes, device=device)
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    res = probe_result(reports)
    if not res.correct:
        raise RuntimeError("all-reduce probe returned a wrong result over torchrun's link")
    log(f"[{TORCHRUN_LINK}] link probe over {res.world_size} processes: all-reduce bus bandwidth "
        f"{format_bps(res.bus_bps)}, round trip {1e3 * res.latency_s:.2f} ms")
    return res
