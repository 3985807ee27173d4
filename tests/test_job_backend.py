"""The job's backend (pufferfish.distributed.env.join_group): NCCL only when every process of the
job drives a GPU no other process drives, asked of the job over a gloo group first, so that
processes a scheduler binds to a GPU each (each seeing one) get NCCL, processes sharing one get
gloo, and every process picks the same."""

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
# Each rank's GPU (as gpu_id says it; None: the CPU or a MIG slice) and the job's answer.
CASES: list[tuple[list[str | None], bool]] = [
    (["GPU-a", "GPU-b", "GPU-c"], True),  # a GPU each, however each process sees it
    (["GPU-a", "GPU-a", "GPU-b"], False),  # two ranks share a GPU: NCCL refuses
    (["n1/0", "n2/0", "n1/1"], True),  # no UUID: index 0 on two machines is two GPUs
    (["GPU-a", "GPU-b", None], False),  # one rank on the CPU
]


def _sum_of_ranks() -> float:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return total.item()


def _worker(rank: int, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    # torchrun's agent store: the launcher hosts it, the workers are its clients
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        backend = join_group("auto", torch.device("cpu"), rank, WORLD, 60)
        answers = [own_gpus(gpus[rank]) for gpus, _ in CASES]
        sums = [_sum_of_ranks()]
        dist.destroy_process_group()  # train() again in this process: the same store
        again = join_group("auto", torch.device("cpu"), rank, WORLD, 60)
        sums.append(_sum_of_ranks())
        queue.put((rank, {"answers": answers, "backends": [backend, again], "sums": sums}))
    except Exception as error:
        queue.put((rank, repr(error)))
        raise
    finally:
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
    try:
        results = dict(queue.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    del server
    want = [answer for _, answer in CASES]
    for rank in range(WORLD):
        assert isinstance(results[rank], dict), results[rank]
        assert results[rank]["answers"] == want, (rank, results[rank])
        # the CPU: gloo, a working group of the three, twice in one process
        assert results[rank]["backends"] == ["gloo", "gloo"] and results[rank]["sums"] == [6.0] * 2
