"""Your own model in ``pufferfish bench``: a factory that returns a ``pufferfish.bench.Workload``.

    pufferfish bench --model examples/bench_my_model.py:make --methods ddp,fp16,powersgd,pufferfish

Every process of the bench imports this file and calls ``make()`` itself, so keep it importable
from a fresh process and free of side effects; build on the CPU (the bench moves nothing).
"""

import torch
import torch.nn.functional as F
from torch import nn

from pufferfish.bench import Workload

FEATURES, CLASSES = 256, 10


def make() -> Workload:
    """A small MLP classifier on random features: what each method trains, on what, with what."""
    model = nn.Sequential(
        nn.Linear(FEATURES, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One process's batch: (inputs, targets). inputs may also be a tuple (positional
        # arguments of the model) or a dict (keyword arguments).
        return torch.randn(batch_size, FEATURES), torch.randint(CLASSES, (batch_size,))

    # loss(outputs, targets) -> a scalar tensor. keep: module names Pufferfish leaves full rank
    # (glob patterns; here the classifier head, "4").
    return Workload(model=model, make_batch=make_batch, loss=F.cross_entropy, keep=["4"])
