"""The user's own model for ``pufferfish bench --model REF``: the :class:`Workload` contract, the
references that name one, and the checks that turn a bad one into a one-line error.

``REF`` is ``PATH.py:FUNC`` (a file, spaces allowed), ``package.module:FUNC`` (importable), or
``hf:PATH/config.json`` (a Hugging Face causal LM built from its config, no download; needs
``transformers``); a ``PATH.py:NAME`` whose ``NAME`` is a ``ModelSpec`` is a model like ours
instead (:mod:`pufferfish.models.spec`). ``FUNC()`` takes no argument and returns a
:class:`Workload`. Every worker process loads the reference itself (the bench passes the string,
never the object), so the factory must be importable from a fresh process and give the same
model there.
"""

from __future__ import annotations

import copy
import functools
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..lowrank import factorize
from ..lowrank.presets import presets_of
from ..lowrank.report import FactorizationReport
from ..models.spec import import_reference, spec_of_reference

__all__ = ["FIND_UNUSED_ATTR", "LOSS_ATTR", "Workload", "build_user_model", "call_model",
           "check_workload", "factorization_report", "is_user_model", "load_workload",
           "user_batches"]

LOSS_ATTR = "_pufferfish_bench_loss"  # the workload's loss, carried by its model (and copies)
FIND_UNUSED_ATTR = "_pufferfish_bench_find_unused"  # Workload.find_unused_parameters, likewise
_HF = "hf:"
_FORMS = "PATH.py:FUNC, package.module:FUNC or hf:CONFIG.json"


@dataclass
class Workload:
    """What ``pufferfish bench`` measures on your model: every method trains ``model`` on
    ``make_batch(batch_size)`` (one process's ``(inputs, targets)``; ``inputs`` a tensor, a tuple
    of positional arguments or a dict of keyword arguments) with ``loss(outputs, targets)``, a
    scalar tensor. Pufferfish factorizes ``model`` at ``rank_ratio`` (unless the bench's
    ``--rank-ratio`` or a method's ``rank_ratio=`` setting says otherwise), keeping the modules
    whose qualified names match ``keep`` (glob patterns) or the model's ``preset`` full rank.
    ``find_unused_parameters``: some trainable parameters may get no gradient in a step (a head the
    loss ignores, a mixture of experts' idle experts); DDP then looks for them after every
    backward, as your own ``DDP(find_unused_parameters=True)`` does."""

    model: nn.Module
    make_batch: Callable[[int], tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    keep: Sequence[str] = ()
    preset: str | None = None
    rank_ratio: float = 0.25
    optimizer: str = "adamw"  # every method's optimizer: adamw or sgd (momentum 0.9)
    find_unused_parameters: bool = False


def is_user_model(ref: str) -> bool:
    """Whether ``--model`` names the user's :class:`Workload` rather than a model spec (ours, or
    the user's ``PATH.py:NAME`` of a ``ModelSpec``, which the bench times as it times ours). A
    reference that does not load is the user's: :func:`load_workload` says what is wrong."""
    if ref.startswith(_HF):
        return True
    if ":" not in ref:
        return False
    try:
        return spec_of_reference(ref) is None
    except ValueError:
        return True


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` on a batch's inputs: a tuple as positional arguments, a dict as keywords."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


@functools.lru_cache(maxsize=8)
def load_workload(ref: str, seq_len: int = 64) -> Workload:
    """The :class:`Workload` ``ref`` names (``seq_len``: tokens per sequence of ``hf:`` batches),
    checked; ``ValueError`` in one line naming what was wrong. Cached per process: a worker builds
    each method's model from it."""
    if ref.startswith(_HF):
        return _hf_workload(ref, ref[len(_HF):], seq_len)
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"--model {ref!r} is invalid: allowed {_FORMS}")
    factory = getattr(import_reference(ref, where), name, None)
    if factory is None:
        raise ValueError(f"--model {ref!r}: {where} has no {name!r}")
    if not callable(factory):
        raise ValueError(f"--model {ref!r}: {name} is not a function ({type(factory).__name__})")
    try:
        workload = factory()
    except Exception as e:  # the user's code: any error is theirs, said in one line
        raise ValueError(f"--model {ref!r}: {name}() raised {type(e).__name__}: {e}") from None
    return _checked(ref, name, workload)


def _checked(ref: str, name: str, workload: Any) -> Workload:
    """``workload`` if it keeps the contract, else a one-line ``ValueError`` saying how not."""
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {ref!r}: {name}() returned a {type(workload).__name__}, "
                         "allowed a pufferfish.bench.Workload(model=..., make_batch=..., loss=...)")
    if not isinstance(workload.model, nn.Module):
        raise ValueError(f"--model {ref!r}: Workload.model is a {type(workload.model).__name__}, "
                         "allowed a torch.nn.Module")
    for field in ("make_batch", "loss"):
        if not callable(getattr(workload, field)):
            raise ValueError(f"--model {ref!r}: Workload.{field} is not callable")
    if workload.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"--model {ref!r}: Workload.optimizer {workload.optimizer!r} is "
                         "invalid: allowed adamw, sgd")
    ratio = workload.rank_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise ValueError(f"--model {ref!r}: Workload.rank_ratio {ratio!r} is invalid: allowed a "
                         "number in (0, 1]")
    workload.rank_ratio = float(ratio)  # 1 is the whole rank, not an absolute rank of 1
    if not isinstance(workload.find_unused_parameters, bool):
        raise ValueError(f"--model {ref!r}: Workload.find_unused_parameters "
                         f"{workload.find_unused_parameters!r} is invalid: allowed True, False")
    return workload


def _hf_workload(ref: str, config_path: str, seq_len: int) -> Workload:
    """A Hugging Face causal LM from ``config_path`` (``AutoModelForCausalLM.from_config``: random
    weights, nothing downloaded), on random token batches of ``seq_len`` with the next-token
    cross-entropy; Pufferfish keeps the preset registered for its class (LLaMA-style: ``paper``)."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--model {ref!r} needs transformers, which is not installed: "
                         "pip install transformers") from None
    if not Path(config_path).is_file():
        raise ValueError(f"--model {ref!r}: no file {config_path!r} (allowed hf:CONFIG.json)")
    try:
        config = transformers.AutoConfig.from_pretrained(config_path)
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # an unreadable file, an unknown model_type, no causal-LM class
        raise ValueError(f"--model {ref!r}: building a causal LM from it raised "
                         f"{_said(e)}") from None
    vocab = int(config.vocab_size)

    def make_batch(batch_size: int) -> tuple[dict[str, Any], torch.Tensor]:
        tokens = torch.randint(vocab, (batch_size, seq_len + 1))
        return {"input_ids": tokens[:, :-1], "use_cache": False}, tokens[:, 1:]

    def loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    preset = "paper" if "paper" in presets_of(model) else None
    return Workload(model=model, make_batch=make_batch, loss=loss, preset=preset)


def check_workload(ref: str, seq_len: int, factorized: bool,
                   rank_ratios: Sequence[float | None] = (None,)) -> None:
    """Before any process starts: ``ref`` loads and one step of batch 2 (``make_batch``, the
    model, ``loss`` a scalar, backward) runs on the model and, if a method is ``factorized``, on
    Pufferfish's factorization of it at each of ``rank_ratios`` (None: the workload's own).
    ``ValueError`` in one line naming what failed. Once per process for the same arguments."""
    _checked_once(ref, seq_len, factorized, tuple(dict.fromkeys(rank_ratios)))


@functools.lru_cache(maxsize=8)
def _checked_once(ref: str, seq_len: int, factorized: bool,
                  rank_ratios: tuple[float | None, ...]) -> None:
    workload = load_workload(ref, seq_len)
    _check_step(ref, workload, _copy(ref, workload.model), "")
    for ratio in rank_ratios if factorized else ():
        model = _copy(ref, workload.model)
        _factorize(ref, workload, model, ratio)
        said = workload.rank_ratio if ratio is None else ratio
        _check_step(ref, workload, model, f" on the factorized model (rank ratio {said:g})")
        del model  # one copy alive at a time
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # a factory that built on the GPU: the check's memory goes back


def _check_step(ref: str, workload: Workload, model: nn.Module, what: str) -> None:
    """One training step's forward, loss and backward on ``make_batch(2)``; the loss must
    depend on the model's trainable parameters, and every one of them get a gradient unless
    ``workload.find_unused_parameters`` (else DDP stops at its second step, in every worker)."""
    try:
        inputs, targets = workload.make_batch(2)
        value = workload.loss(call_model(model, inputs), targets)
    except Exception as e:  # the user's code: said in one line
        raise ValueError(f"--model {ref!r}: a step on make_batch(2){what} raised {_said(e)}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"--model {ref!r}: loss(outputs, targets){what} returned "
                         f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}, "
                         "allowed a scalar tensor")
    if not value.requires_grad:  # detached outputs, no_grad, or nothing trainable: DDP refuses
        raise ValueError(f"--model {ref!r}: loss(outputs, targets){what} does not depend on any "
                         "trainable parameter: allowed a loss computed with gradients from a "
                         "model with parameters to train")
    try:
        value.backward()
    except Exception as e:
        raise ValueError(f"--model {ref!r}: backward of loss(outputs, targets){what} raised "
                         f"{_said(e)}") from None
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused and not workload.find_unused_parameters:
        remedy = ("a model whose trainable parameters all get a gradient (write a PATH.py:FUNC "
                  "factory building this one with Workload(find_unused_parameters=True))"
                  if ref.startswith(_HF) else "Workload(find_unused_parameters=True), as your "
                  "own DDP needs, or those parameters frozen (requires_grad_(False))")
        raise ValueError(
            f"--model {ref!r}: {len(unused)} trainable parameter(s) get no gradient from the "
            f"loss{what} ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}), which "
            f"stops DDP at its second step: allowed {remedy}")


def _said(e: Exception) -> str:
    """An exception from the user's code in one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _copy(ref: str, model: nn.Module) -> nn.Module:
    """A deep copy of the workload's model (one per method), or a one-line ``ValueError``."""
    try:
        return copy.deepcopy(model)
    except Exception as e:  # torch.nn.utils.weight_norm's computed weight, an open file, a lock
        raise ValueError(
            f"--model {ref!r}: copying the model raised {_said(e)} (the bench trains a copy per "
            "method; "
            "torch.nn.utils.weight_norm: use torch.nn.utils.parametrizations.weight_norm)") from None


def build_user_model(ref: str, seq_len: int, factorized: bool,
                     rank_ratio: float | None = None) -> tuple[nn.Module, int]:
    """A fresh copy of the workload's model (factorized as :func:`factorization_report` says when
    ``factorized``, at ``rank_ratio`` or the workload's own) carrying its loss, and its full-rank
    parameter count."""
    workload = load_workload(ref, seq_len)
    model = _copy(ref, workload.model)
    full = sum(p.numel() for p in model.parameters())
    if factorized:
        _factorize(ref, workload, model, rank_ratio)
    setattr(model, LOSS_ATTR, workload.loss)
    setattr(model, FIND_UNUSED_ATTR, workload.find_unused_parameters)
    return model, full


def factorization_report(ref: str, seq_len: int = 64,
                         rank_ratio: float | None = None) -> FactorizationReport:
    """What Pufferfish makes of the workload's model (on a copy) at ``rank_ratio`` (None: the
    workload's own); ``ValueError`` if nothing."""
    workload = load_workload(ref, seq_len)
    return _factorize(ref, workload, _copy(ref, workload.model), rank_ratio)


def _factorize(ref: str, workload: Workload, model: nn.Module,
               rank_ratio: float | None = None) -> FactorizationReport:
    ratio = workload.rank_ratio if rank_ratio is None else rank_ratio
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "changed nothing" is refused below, in one line
            report = factorize(model, rank_ratio=ratio, keep=workload.keep,
                               preset=workload.preset)
    except ValueError as e:  # a keep pattern that matches nothing, an unknown preset
        raise ValueError(f"--model {ref!r}: {e}") from None
    if not report.factorized:
        kept = sorted({d.reason for d in report.layers}) or ["no layer with a weight matrix"]
        raise ValueError(f"--model {ref!r}: Pufferfish has nothing to factorize in "
                         f"{type(model).__name__} ({'; '.join(kept)[:200]}): allowed a model with "
                         "Linear/Conv/LSTM/attention layers it may make low rank")
    return report


def user_batches(ref: str, seq_len: int, batch_size: int, n: int,
                 seed: int = 0) -> list[tuple[Any, Any]]:
    """``n`` of the workload's batches (after ``torch.manual_seed(seed)``: each rank its own),
    made before anything is timed."""
    make_batch = load_workload(ref, seq_len).make_batch
    torch.manual_seed(seed)
    return [make_batch(batch_size) for _ in range(n)]
