"""A Lightning run with PufferfishCallback, for tests: one process, or two under torchrun.

``python tests/lightning_trainer_run.py OUT_DIR`` trains a small MLP classifier (a
``LightningModule`` with AdamW in two groups and a StepLR schedule) on synthetic data for 3
epochs, switching after 1, and writes ``OUT_DIR/rank{R}.json``: what the switch did, the LR of
every step, and the gap between the ranks' parameters. Under ``torchrun --nproc-per-node 2`` it
runs ``strategy="ddp"`` on 2 CPU processes (Lightning joins torchrun's environment).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_module() -> Any:
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                     nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
            self.lrs: list[list[float]] = []
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.lrs.append([g["lr"] for g in self.trainer.optimizers[0].param_groups])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            named = list(self.named_parameters())
            optimizer = torch.optim.AdamW(
                [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
                 {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0,
                  "lr": 5e-3}], lr=1e-2)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Classifier()


def data(seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :4].argmax(dim=1)).long()  # learnable labels
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


HOOK_STATE: dict[str, Any] = {"switched": False, "before_switch": 0, "after_switch": 0}


def counting_allreduce(state, bucket):  # unannotated: DDP checks real annotations, not strings
    """The user's DDP comm hook: an averaging all-reduce that counts its calls."""
    import torch.distributed as dist

    state["after_switch" if state["switched"] else "before_switch"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def trainer(callbacks: list[Any], world: int, **overrides: Any) -> Any:
    import lightning.pytorch as pl

    options = dict(max_epochs=3, accelerator="cpu", devices=world,
                   strategy="ddp" if world > 1 else "auto", callbacks=callbacks, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, deterministic=True)
    options.update(overrides)
    return pl.Trainer(**options)


def main(out: str) -> None:
    import torch.distributed as dist

    from pufferfish.integrations.lightning import PufferfishCallback
    from pufferfish.lowrank import LowRankModule

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(rank)  # different initial weights on each rank: DDP must make them agree
    module = make_module()
    callback = PufferfishCallback(warmup_epochs=1, rank_ratio=0.25, keep=["net.0"],
                                  verbose=rank == 0)
    probe = make_probe()
    run = trainer([callback, probe], world)
    run.fit(module, data())
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [flat]
    if dist.is_initialized():
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
    result = {
        "rank": rank,
        "world": len(gathered),
        "switched_at": callback.recipe.switched_at,
        "switched_at_step": callback.switcher.switched_at_step,
        "params_after": callback.report.params_after if callback.report else None,
        "lowrank_modules": sum(isinstance(m, LowRankModule) for m in module.modules()),
        **probe.seen,
        "hook_calls": {k: v for k, v in HOOK_STATE.items() if k != "switched"},
        "replica_gap": max((g - gathered[0]).abs().max().item() for g in gathered),
        "losses": module.losses,
        "lrs": module.lrs,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def make_probe() -> Any:
    """A callback that looks at the strategy's model wrapper before and after training."""
    import lightning.pytorch as pl
    from torch.nn.parallel import DistributedDataParallel

    from pufferfish.distributed.env import ddp_options

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.seen: dict[str, Any] = {}
            self.optimizer: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.wrapper, self.optimizer = trainer.strategy.model, trainer.optimizers[0]
            self.forwards = 0
            if isinstance(self.wrapper, DistributedDataParallel):
                # the user's comm hook (Lightning's ddp_comm_hook= registers on CUDA only)
                self.wrapper.register_comm_hook(HOOK_STATE, counting_allreduce)
                self.options = ddp_options(self.wrapper)
                self.wrapper.register_forward_pre_hook(self.count_forward)  # on the wrapper

        def count_forward(self, module: Any, args: Any) -> None:
            self.forwards += 1

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            HOOK_STATE["switched"] = trainer.current_epoch >= 1  # runs after the switch's hook

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            wrapper = trainer.strategy.model  # Lightning unwraps it at teardown, after this
            self.seen = {"wrapper": type(wrapper).__name__,
                         "same_wrapper": wrapper is self.wrapper,
                         "same_optimizer": trainer.optimizers[0] is self.optimizer,
                         "reducer_sees_factors": _reducer_covers(wrapper, pl_module),
                         "options_kept": isinstance(wrapper, DistributedDataParallel)
                         and ddp_options(wrapper) == self.options,
                         "wrapper_hook_calls": self.forwards}

    return Probe()


def _reducer_covers(wrapper: Any, module: Any) -> bool | None:
    """Whether the DDP wrapper's parameter list is exactly the module's (None: no DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(wrapper, DistributedDataParallel):
        return None
    return {id(p) for p in wrapper._module_parameters} == {id(p) for p in module.parameters()}


if __name__ == "__main__":
    from pufferfish.distributed.env import cleanup, exit_process

    main(sys.argv[1])
    cleanup()  # comm hooks with Python callbacks ran: drained teardown, no interpreter shutdown
    exit_process(0)
