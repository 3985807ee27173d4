"""``--tokens-per-param N``: a language model's run length as a token budget.

The budget is ``N`` times the parameters of the *full-rank* model (so every ``--mode`` sees the
same tokens, whatever it trains), and it becomes two ordinary settings before anything else reads
the configuration: the fewest passes ``E`` over the training split that hold it (``epochs``,
at most the ``--epochs`` given) and the first ``ceil(budget / E)`` training tokens
(``train_subset``). So a budget within the corpus is one pass over that many unique tokens, and a
larger one ``E`` passes over an equal share of it; the loop, the schedules (LR, switch) and resume
see plain epochs, and a resumed run resolves to the same values.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import models
from ..config import ConfigError, TrainConfig
from ..distributed.env import DistEnv

__all__ = ["full_rank_params", "resolve_token_budget"]


def full_rank_params(cfg: TrainConfig, vocab_size: int) -> int:
    """Parameters of ``cfg``'s full-rank model (a packed LM, as llama; built on the meta
    device: no memory, no time)."""
    with torch.device("meta"):
        model = models.build_at_width(cfg.model, cfg.width, vocab_size=vocab_size,
                                      max_len=cfg.seq_len)
    return sum(p.numel() for p in model.parameters())


def resolve_token_budget(cfg: TrainConfig, env: DistEnv) -> TrainConfig:
    """``cfg`` with ``epochs`` and ``train_subset`` set from ``tokens_per_param`` (unchanged if
    it is 0); a budget beyond ``--epochs`` passes over the corpus is a ConfigError."""
    if not cfg.tokens_per_param:
        return cfg
    if models.get_spec(cfg.model).task != "lm-packed":
        packed = ", ".join(n for n in models.model_names()
                           if models.get_spec(n).task == "lm-packed")
        raise ConfigError(f"tokens_per_param is for --model {packed} (packed BPE tokens), not "
                          f"{cfg.model!r}: allowed 0 with other models, or set --epochs")
    from .packed_lm import load_corpus  # the corpus is cached: rank 0 builds it, others read

    corpus = load_corpus(cfg, env)
    params = full_rank_params(cfg, corpus.vocab_size)
    budget = math.ceil(cfg.tokens_per_param * params)
    available = len(corpus.train)
    passes = math.ceil(budget / available)
    if passes > cfg.epochs:
        most = cfg.epochs * available / params
        raise ConfigError(f"tokens_per_param {cfg.tokens_per_param:g} is {budget:,} tokens for "
                          f"{params:,} parameters: {passes} passes over the {available:,} "
                          f"training tokens of {cfg.data}; allowed up to {most:.4g} with --epochs "
                          f"{cfg.epochs} (or raise --epochs to {passes})")
    subset = math.ceil(budget / passes)
    if subset < cfg.seq_len * cfg.batch_size * env.world_size:
        raise ConfigError(f"tokens_per_param {cfg.tokens_per_param:g} is {budget:,} tokens: less "
                          f"than one step of {env.world_size} x {cfg.batch_size} x {cfg.seq_len}; "
                          "allowed a larger budget or a smaller --batch-size")
    if cfg.train_subset not in (0, subset):  # a resolved config (a resume's) gives subset again
        raise ConfigError(f"tokens_per_param {cfg.tokens_per_param:g} sets the training tokens "
                          f"itself ({subset:,}): allowed train_subset 0 with it (got "
                          f"{cfg.train_subset})")
    return dataclasses.replace(cfg, epochs=passes, train_subset=subset)
