"""A Hugging Face Trainer run with PufferfishCallback, for tests: one process, or two under torchrun.

``python tests/hf_trainer_run.py OUT_DIR`` trains a tiny GPT-2 (built from a config) on synthetic
tokens for 3 epochs, switching after 1, and writes ``OUT_DIR/rank{R}.json``: what the switch did
and a flat copy of the parameters, gathered across ranks; then the same in a plain Accelerate
loop (the README's recipe for Accelerate users).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB, LENGTH = 64, 16


class Tokens(Dataset):
    """Random token sequences; a causal LM learns their unigram statistics."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def training_arguments(out: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options = dict(output_dir=out, num_train_epochs=3, per_device_train_batch_size=4,
                   learning_rate=1e-3, weight_decay=0.01, lr_scheduler_type="linear",
                   warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[],
                   use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    options.update(overrides)
    return TrainingArguments(**options)


def main(out: str) -> None:
    import torch.distributed as dist
    from transformers import Trainer

    from pufferfish.integrations.hf import PufferfishCallback
    from pufferfish.lowrank import LowRankModule

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(rank)  # different initial weights on each rank: DDP must make them agree
    model = tiny_gpt2()
    callback = PufferfishCallback(warmup_epochs=1, rank_ratio=0.25, verbose=rank == 0)
    probe = make_probe()
    trainer = Trainer(model=model, args=training_arguments(os.path.join(out, "hf")),
                      train_dataset=Tokens(), callbacks=[callback, probe])
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [flat]
    if dist.is_initialized():
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
    wrapper = trainer.model_wrapped
    result = {
        "rank": rank,
        "world": len(gathered),
        "switched_at": callback.recipe.switched_at,
        "switched_at_step": callback.switcher.switched_at_step,
        "params_after": callback.report.params_after if callback.report else None,
        "lowrank_modules": sum(isinstance(m, LowRankModule) for m in model.modules()),
        "wrapper": type(wrapper).__name__,
        "same_wrapper": wrapper is probe.wrapper_at_start,
        "same_optimizer": trainer.optimizer is probe.optimizer_at_start,
        "reducer_sees_factors": _reducer_covers(wrapper, model),
        "replica_gap": max((g - gathered[0]).abs().max().item() for g in gathered),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "accelerate": accelerate_loop(rank),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def accelerate_loop(rank: int) -> dict[str, Any]:
    """The README's recipe for a plain Accelerate loop: Recipe.switch on the unwrapped model and
    the prepared optimizer, then the prepared DDP wrapper rebuilt in place."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    import pufferfish as pf
    from pufferfish.distributed.env import rebuild_ddp_in_place

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(rank)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, 12)
    loader = DataLoader(Tokens(), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    wrapper, recipe = model, pf.Recipe(warmup_epochs=1)
    for epoch in range(3):
        inner = accelerator.unwrap_model(model)
        if recipe.should_switch(epoch, inner):
            recipe.switch(epoch, inner, optimizer)  # the prepared optimizer, edited in place
            if isinstance(model, DistributedDataParallel):
                rebuild_ddp_in_place(model)  # the object accelerate holds stays the wrapper
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = [flat]
    if dist.is_initialized():
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
    return {"wrapper": type(model).__name__, "same_wrapper": model is wrapper,
            "params_after": recipe.report.params_after if recipe.report else None,
            "replica_gap": max((g - gathered[0]).abs().max().item() for g in gathered)}


def make_probe() -> Any:
    """A callback that keeps what the Trainer hands callbacks at the start of training."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        optimizer_at_start: Any = None
        wrapper_at_start: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                           model: Any = None, **kwargs: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            self.optimizer_at_start = optimizer
            self.wrapper_at_start = next((o for o in gc.get_objects() if isinstance(
                o, DistributedDataParallel) and o.module is model), model)

    return Probe()


def _reducer_covers(wrapper: Any, model: Any) -> bool | None:
    """Whether the DDP wrapper's parameter list is exactly the model's (None: no DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(wrapper, DistributedDataParallel):
        return None
    return {id(p) for p in wrapper._module_parameters} == {id(p) for p in model.parameters()}


if __name__ == "__main__":
    from pufferfish.distributed.env import cleanup, exit_process

    main(sys.argv[1])
    cleanup()  # comm hooks with Python callbacks ran: drained teardown, no interpreter shutdown
    exit_process(0)
