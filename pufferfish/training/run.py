"""Where a training run is, and what the loop mutates as it goes (:mod:`.loop`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from ..distributed.buckets import BucketTuner
from ..distributed.diloco import DiLoCoState
from .methods import Change
from .step import EpochMeter, Replica


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
    bar: Any = None  # rank 0's bar of the whole run (progressbar.run_bar)
