"""Worker of tests/test_fsdp.py, run under torchrun (gloo): ``python fsdp_worker.py MODE OUT``.

``recipe``: a user's own ``fully_shard``-ed ResNet-18 through ``pf.Recipe``'s switch, against the
same recipe on an unsharded model fed both ranks' half-batches (what data parallel computes);
writes both loss sequences and what the switch did to the optimizer.
``lightning ddp|fsdp``: the Lightning callback's switch under ``strategy="ddp"`` and under
``ModelParallelStrategy`` (the module shards each of its layers with ``fully_shard`` in
``configure_model``); writes rank 0's losses and what the switch did.
``count``: the bytes FSDP2 hands to its all-gathers and reduce-scatters in one training step,
counted at ``torch.distributed``, before and after the switch, beside
:func:`pufferfish.distributed.fsdp.comm_bytes`.
``save`` / ``load``: the sharded state of a switched model written with ``save_sharded`` by this
group, and read back by a group of another size (DCP reshards), with the full tensors of both
sides for an exact comparison.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import pufferfish as pf
from pufferfish.distributed import fsdp
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.models import build_at_width
from pufferfish.training import checkpoint as ckpt

warnings.simplefilter("ignore")
torch.set_num_threads(1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return build_at_width("resnet18", 0.125, num_classes=10, in_channels=1, image_size=28)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(steps)]


def recipe(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(6)
    runs = {}
    for sharded in (True, False):
        m = model()
        if sharded:  # the user's own sharding: each residual block, then the root
            for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
                for block in layer:
                    fully_shard(block)
            fully_shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        rec = pf.Recipe(warmup_epochs=1, preset="paper", example_input=data[0][0][:1])
        losses, record = [], {}
        for epoch in range(2):
            model_after, opt_after, sched_after = rec.on_epoch_start(epoch, m, opt, sched)
            assert model_after is m and opt_after is opt and sched_after is sched
            if epoch == 1:
                ids = {id(p) for g in opt.param_groups for p in g["params"]}
                record = {"same_params": ids == {id(p) for p in m.parameters()},
                          "all_sharded": all(isinstance(p, DTensor) for p in m.parameters()),
                          "kept_with_state": sum(p in opt.state for p in m.parameters()),
                          "lr": opt.param_groups[0]["lr"], "removed": len(rec.parameter_swap.removed),
                          "added": len(rec.parameter_swap.added)}
            for x, y in data[epoch * 3:(epoch + 1) * 3]:
                halves = x.chunk(world), y.chunk(world)
                if sharded:
                    loss = nn.functional.cross_entropy(m(halves[0][rank]), halves[1][rank])
                    opt.zero_grad()
                    loss.backward()
                    total = loss.detach().clone()
                    dist.all_reduce(total)
                    losses.append(total.item() / world)
                else:  # data parallel's gradient: the mean of the ranks' half-batch losses
                    loss = sum(nn.functional.cross_entropy(m(a), b)
                               for a, b in zip(*halves)) / world
                    opt.zero_grad()
                    loss.backward()
                    losses.append(loss.item())
                opt.step()
                sched.step()
        runs["fsdp" if sharded else "reference"] = {"losses": losses, **record}
    if rank == 0:
        out.write_text(json.dumps(runs))


def switched() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded ResNet-18 after the switch, with optimizer state (the loop's way)."""
    m = fsdp.shard(model())
    rec = pf.Recipe(warmup_epochs=0, preset="paper")
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    rec.on_epoch_start(0, m, opt)
    return m, opt, rec


def full(state: dict) -> dict:
    """Every tensor of a nested state dict as a full plain tensor (gathers DTensors)."""
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return state.full_tensor()
    return state


def save(out: Path) -> None:
    m, opt, rec = switched()
    data = batches(2)
    for x, y in data:
        x, y = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[
            dist.get_rank()]
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    state = fsdp.sharded_state(m, opt)
    record = ckpt.save_sharded(out, 5, state, dist.get_rank() == 0)
    reference = full(state)
    if dist.get_rank() == 0:
        torch.save({"record": record, "state": reference, "switch": rec.state_dict()},
                   out / "reference.pt")


def load(out: Path, again: Path | None) -> None:
    saved = torch.load(out / "reference.pt", weights_only=True)
    m = model()
    rec = pf.Recipe(warmup_epochs=0, preset="paper")
    rec.load_state_dict(saved["switch"], m)
    rec.switch_owner.plan.rebuild(m)  # the factorized architecture, dense, then sharded
    fsdp.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    state = fsdp.sharded_state(m, opt)
    ckpt.load_sharded(out / "checkpoints" / "ckpt-000000005.pt", saved["record"], state)
    fsdp.load_sharded_state(m, opt, state)
    got = full(fsdp.sharded_state(m, opt))
    diffs = [k for k, v in got["model"].items() if not torch.equal(v, saved["state"]["model"][k])]
    diffs += [f"optimizer {k}" for k, v in got["optimizer"]["state"].items()
              if not torch.equal(v["momentum_buffer"],
                                 saved["state"]["optimizer"]["state"][k]["momentum_buffer"])]
    if dist.get_rank() == 0:
        (out / f"load-{dist.get_world_size()}.json").write_text(json.dumps(
            {"diffs": diffs, "n": len(got["model"]),
             "momenta": len(got["optimizer"]["state"])}))
    if again is not None:  # written again by this group, for the way back
        record = ckpt.save_sharded(again, 5, fsdp.sharded_state(m, opt), dist.get_rank() == 0)
        if dist.get_rank() == 0:
            torch.save({**saved, "record": record}, again / "reference.pt")


def count(out: Path) -> None:
    counted = {"all_gather": 0, "reduce_scatter": 0, "calls": 0}

    def counting(name: str, collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            counted[name] += tensor.numel() * tensor.element_size()
            counted["calls"] += 1
            return collective(*args, **kwargs)
        return call

    dist.all_gather_single = counting("all_gather", dist.all_gather_single)
    dist.reduce_scatter_single = counting("reduce_scatter", dist.reduce_scatter_single)
    m = fsdp.shard(model())
    x, y = batches(1)[0]
    rows = []
    for switch in (False, True):
        if switch:
            pf.Recipe(warmup_epochs=0, preset="paper").on_epoch_start(0, m, None)
        for _ in range(2):  # the second step counted (the first one lazily initializes)
            for key in counted:
                counted[key] = 0
            nn.functional.cross_entropy(m(x), y).backward()
        predicted = fsdp.comm_bytes(m, dist.get_world_size())
        rows.append({"counted": dict(counted), "all_gather": predicted.all_gather,
                     "reduce_scatter": predicted.reduce_scatter,
                     "collectives": predicted.collectives})
    for key in counted:  # a step of 2 micro-batches (--grad-accum 2): one reduce-scatter
        counted[key] = 0
    with fsdp.gradient_sync_off(m):
        nn.functional.cross_entropy(m(x), y).backward()
    nn.functional.cross_entropy(m(x), y).backward()
    predicted = fsdp.comm_bytes(m, dist.get_world_size(), micro_batches=2)
    rows.append({"counted": dict(counted), "all_gather": predicted.all_gather,
                 "reduce_scatter": predicted.reduce_scatter, "collectives": predicted.collectives})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))


def lightning(out: Path, strategy: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from pufferfish.integrations.lightning import PufferfishCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                     nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if strategy == "fsdp":  # the user's own sharding: each layer, then the network
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    module = Classifier()
    callback = PufferfishCallback(warmup_epochs=1, rank_ratio=0.25, keep=["net.0"], verbose=False)
    chosen = (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
              if strategy == "fsdp" else "ddp")
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=2, strategy=chosen,
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8))
    if dist.get_rank() == 0:
        out.write_text(json.dumps({
            "losses": module.losses, "switched_at": callback.recipe.switched_at,
            "params_after": callback.report.params_after,
            "sharded": all(isinstance(p, DTensor) for p in module.parameters())}))


if __name__ == "__main__":
    if sys.argv[1] != "lightning":  # Lightning forms its own group
        dist.init_process_group("gloo")
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"recipe": lambda: recipe(out), "save": lambda: save(out),
     "lightning": lambda: lightning(out, sys.argv[3]), "count": lambda: count(out),
     "load": lambda: load(out, Path(sys.argv[3]) if len(sys.argv) > 3 else None)}[mode]()
    cleanup()  # a barrier, then the group torn down; no interpreter shutdown after a group:
    exit_process(0)  # a gloo thread may still release a Python object (docs/reliability.md)
