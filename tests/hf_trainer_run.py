"""A Hugging Face Trainer run with PufferfishCallback, for tests: one process, or two under torchrun.

``python tests/hf_trainer_run.py OUT_DIR`` trains a tiny GPT-2 (built from a config) on synthetic
tokens for 3 epochs, switching after 1, and writes ``OUT_DIR/rank{R}.json``: what the switch did
and a flat copy of the parameters, gathered across ranks.
"""

from __future__ import annotations

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
    trainer = Trainer(model=model, args=training_arguments(os.path.join(out, "hf")),
                      train_dataset=Tokens(), callbacks=[callback])
    optimizer = None

    class Spy(PufferfishCallback.__mro__[1]):  # TrainerCallback: what the Trainer holds
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            nonlocal optimizer_at_start
            optimizer_at_start = optimizer

    optimizer_at_start = None
    trainer.add_callback(Spy())
    trainer.train()
    optimizer = trainer.optimizer
    wrapper = trainer.model_wrapped
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [torch.empty_like(flat) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, flat)
    else:
        gathered = [flat]
    result = {
        "rank": rank,
        "world": world,
        "switched_at": callback.recipe.switched_at,
        "switched_at_step": callback.switcher.switched_at_step,
        "params_after": callback.report.params_after if callback.report else None,
        "lowrank_modules": sum(isinstance(m, LowRankModule) for m in model.modules()),
        "wrapper": type(wrapper).__name__,
        "same_wrapper": callback._wrapper is not None and callback._wrapper() is wrapper,
        "reducer_sees_factors": _reducer_covers(wrapper, model),
        "same_optimizer": optimizer is optimizer_at_start,
        "replica_gap": max((g - gathered[0]).abs().max().item() for g in gathered),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _reducer_covers(wrapper: Any, model: Any) -> bool | None:
    """Whether the DDP wrapper's parameter list is exactly the model's (None: no DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(wrapper, DistributedDataParallel):
        return None
    return {id(p) for p in wrapper._module_parameters} == {id(p) for p in model.parameters()}


if __name__ == "__main__":
    main(sys.argv[1])
