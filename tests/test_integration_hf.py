"""PufferfishCallback in the real Hugging Face Trainer: BERT and GPT-2 built from tiny configs.

One process: the switch at the right epoch or step, the Trainer's own optimizer kept with HF's
decay / no-decay groups, the LR schedule identical to a run without the callback, resume after
the switch identical to the uninterrupted run. Two processes (torchrun, gloo): the switch on
both ranks, the Trainer's DDP wrapper rebuilt in place, replicas identical after the switch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

pytest.importorskip("accelerate")  # the Trainer's own dependency
transformers = pytest.importorskip("transformers")

from hf_trainer_run import Tokens, make_probe, tiny_gpt2, training_arguments  # noqa: E402
from torchrun_script import ROOT, run_torchrun  # noqa: E402

from pufferfish.integrations.hf import PufferfishCallback  # noqa: E402
from pufferfish.lowrank import LowRankModule  # noqa: E402


class Sentences(Dataset):
    """Token sequences whose label is the most frequent of 3 token groups: learnable by BERT."""

    def __init__(self, n: int = 32, length: int = 12, vocab: int = 60) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.labels = torch.stack([torch.bincount(r // (vocab // 3), minlength=3).argmax()
                                   for r in self.ids])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def tiny_bert() -> Any:
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _train_bert(tmp_path: Path, callback: Any = None, **overrides: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = tiny_bert()
    probe = make_probe()
    callbacks = [probe] + ([callback] if callback is not None else [])
    trainer = transformers.Trainer(model=model, args=training_arguments(str(tmp_path), **overrides),
                                   train_dataset=Sentences(), callbacks=callbacks)
    trainer.train()
    return trainer, probe


def _lrs(trainer: Any) -> list[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def test_switch_after_warmup_keeps_the_trainers_optimizer_and_schedule(tmp_path: Path) -> None:
    callback = PufferfishCallback(warmup_epochs=1, rank_ratio=0.25, verbose=False)
    trainer, probe = _train_bert(tmp_path / "a", callback)
    model = trainer.model

    assert callback.recipe.switched_at == 1 and callback.switcher.switched_at_step == 8
    report = callback.report
    # q, k, v, attention out, intermediate, output: 6 per layer, 2 layers; pooler; classifier
    assert report is not None and len(report.factorized) == 14
    assert report.params_after == sum(p.numel() for p in model.parameters()) < report.params_before
    assert sum(isinstance(m, LowRankModule) for m in model.modules()) == 14

    optimizer = trainer.optimizer
    assert optimizer is probe.optimizer_at_start  # the Trainer's object, edited in place
    groups = optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    # HF's rule (no decay on biases and LayerNorm) holds for the factorized model's parameters
    decay = set(trainer.get_decay_parameter_names(model))
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in groups[0]["params"]} == decay
    assert {names[id(p)] for p in groups[1]["params"]} == set(names.values()) - decay

    without, _ = _train_bert(tmp_path / "b")
    assert _lrs(trainer) == _lrs(without)  # the LR schedule is exactly the Trainer's own
    assert len(set(_lrs(trainer)[8:])) > 1  # and it moves after the switch
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 24 and all(math.isfinite(v) for v in losses)


def test_step_based_switch_for_max_steps_runs(tmp_path: Path) -> None:
    callback = PufferfishCallback(warmup_steps=5, verbose=False)
    trainer, _ = _train_bert(tmp_path, callback, max_steps=7, num_train_epochs=-1)
    assert trainer.state.global_step == 7
    assert callback.switcher.switched_at_step == 5 and callback.recipe.switched_at == 0
    assert callback.report is not None and callback.report.factorized


def test_warmup_steps_and_epochs_are_exclusive() -> None:
    with pytest.raises(ValueError, match="warmup_epochs 1 and warmup_steps 5 are both given"):
        PufferfishCallback(warmup_epochs=1, warmup_steps=5)
    with pytest.raises(ValueError, match="warmup_steps -1 is invalid: allowed an integer >= 0"):
        PufferfishCallback(warmup_steps=-1)
    with pytest.raises(ValueError, match="rank_ratio 2 is invalid"):  # Recipe's own check
        PufferfishCallback(rank_ratio=2)


# ---------------------------------------------------------------------------------------------
# Resume after the switch
# ---------------------------------------------------------------------------------------------

def _gpt2_run(out: Path, resume: str | None = None, late: bool = False
              ) -> tuple[torch.Tensor, Any]:
    torch.manual_seed(0)
    model = tiny_gpt2()
    callback = PufferfishCallback(warmup_epochs=1, verbose=False)
    args = training_arguments(str(out), save_strategy="epoch", per_device_train_batch_size=8)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[] if late else [callback])
    if late:
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), callback


def test_resume_after_the_switch_continues_the_same_run(tmp_path: Path) -> None:
    whole, _ = _gpt2_run(tmp_path)  # 3 epochs of 4 steps, switch at epoch 1, saved every epoch
    checkpoint = tmp_path / "checkpoint-8"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["PufferfishCallback"]["attributes"]["saved_state"]
    assert state["recipe"]["switched_at"] == 1 and state["switched_at_step"] == 4

    resumed, callback = _gpt2_run(tmp_path, resume=str(checkpoint))
    assert callback.recipe.switched_at == 1 and callback.report is None  # no second switch
    # factorized weights and Adam moments on the right tensors: the same run, to the bit
    assert torch.equal(resumed, whole)


def test_resume_after_the_switch_fails_loudly_without_the_structure(tmp_path: Path) -> None:
    _gpt2_run(tmp_path)
    # added after the Trainer was built, the callback cannot rebuild the low-rank structure
    # before the Trainer loads the weights (it loads them with strict=False): the resumed run
    # stops instead of training a half-loaded dense model
    with pytest.raises((RuntimeError, ValueError)):
        _gpt2_run(tmp_path, resume=str(tmp_path / "checkpoint-8"), late=True)


# ---------------------------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------------------------

def test_two_processes_switch_together_and_stay_identical(tmp_path: Path) -> None:
    ranks = run_torchrun("hf_trainer_run.py", tmp_path)
    for r in ranks:
        assert r["world"] == 2 and r["switched_at"] == 1 and r["switched_at_step"] == 4
        assert r["lowrank_modules"] == 8 and r["params_after"] == 11_648
        assert r["wrapper"] == "DistributedDataParallel"
        assert r["same_wrapper"] and r["same_optimizer"]  # rebuilt in place, not replaced
        assert r["reducer_sees_factors"]
        # different initial weights and data on each rank; 8 steps after the switch: gradients
        # of the factors were all-reduced, or the replicas would have drifted apart
        assert r["replica_gap"] == 0.0
        assert all(math.isfinite(v) for v in r["losses"])
        # a plain Accelerate loop, switched as the README says: the same guarantees
        assert r["accelerate"] == {"wrapper": "DistributedDataParallel", "same_wrapper": True,
                                   "params_after": 11_648, "replica_gap": 0.0}


def test_import_pufferfish_imports_no_trainer_library() -> None:
    code = ("import sys, pufferfish, pufferfish.integrations, pufferfish.integrations.core; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', "
            "'accelerate') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
