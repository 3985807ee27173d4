"""The job's backend (pufferfish.distributed.env.join_group): NCCL only when every process of the
job drives a GPU no other process drives, asked of the job through torchrun's store, so that
processes bound to a GPU each by the scheduler (each seeing one) get NCCL, processes sharing one
get gloo, and every process picks the same."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from typing import Any

import torch
import torch.distributed as dist
from helpers import free_port

from pufferfish.distributed.env import cleanup, exit_process, join_group, own_gpus

WORLD = 3
# Each rank's GPU (host/UUID as gpu_id says it; None: the CPU) and the job's answer.
CASES: list[tuple[list[str | None], bool]] = [
    (["n1/GPU-a", "n1/GPU-b", "n1/GPU-c"], True),  # one machine, a GPU each
    (["n1/GPU-a", "n1/GPU-a", "n1/GPU-b"], False),  # two ranks share a GPU: NCCL refuses
    (["n1/0", "n2/0", "n1/1"], True),  # index 0 on two machines: two GPUs
    (["n1/GPU-a", "n1/GPU-b", None], False),  # one rank on the CPU
]


def _worker(rank: int, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    # torchrun's agent store: the launcher hosts it, the workers are its clients
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    answers = [own_gpus(dist.PrefixStore(f"case{i}", store), WORLD, gpus[rank])
               for i, (gpus, _) in enumerate(CASES)]
    backend = join_group("auto", torch.device("cpu"), rank, WORLD, 60)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    queue.put((rank, {"answers": answers, "backend": backend, "sum": total.item()}))
    queue.close()
    queue.join_thread()
    cleanup(drain=True)
    exit_process(0)


def test_every_process_gets_the_job_s_answer() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=True,
                           timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    del server
    want = [answer for _, answer in CASES]
    for rank in range(WORLD):
        assert results[rank]["answers"] == want, (rank, results[rank])
        # the CPU: gloo, a working group of the three
        assert results[rank]["backend"] == "gloo" and results[rank]["sum"] == 6.0
