"""A model is a spec: one :class:`ModelSpec` per model says everything the package asks of it.

Training, ``pufferfish factorize`` and ``pufferfish bench`` read a model's spec and never compare
its name: how to build it at a width, which task trains it (a *kind*, which ``training/tasks.py``
maps to its classes, since ``models/`` sits below ``training/``), its training defaults and
checks, its sample input and how the bench times it. The built-in models register themselves in
:mod:`pufferfish.models`; yours register with :func:`register_model`, or are named as
``PATH.py:NAME`` / ``package.module:NAME`` (``NAME`` a ``ModelSpec`` there), which every process
loads on its own, so a reference reaches torchrun's and the bench's workers (a registration made
in one process does not).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["TASK_KINDS", "ModelSpec", "absolute_reference", "get_spec", "import_reference",
           "model_names", "register_model", "spec_of_reference"]

# image: classification on an image dataset (ImageTask); lm-bptt: a word-level LM on BPTT chunks
# of the corpus (LanguageTask); lm-packed: a decoder LM on packed BPE sequences (PackedLMTask).
TASK_KINDS = ("image", "lm-bptt", "lm-packed")
BENCH_OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the package asks of a model.

    ``build(width, **shapes)`` returns the model at ``width`` for the data's shapes: keywords
    ``num_classes``, ``in_channels``, ``image_size`` (images), ``vocab_size``, ``dropout``,
    ``max_len`` (LMs); it takes those it needs and ignores the rest (``**_``). ``task``: one of
    :data:`TASK_KINDS`. ``batch_first``: an LM's tokens are ``(batch, seq)`` (else ``(seq,
    batch)``, the LSTM's). ``presets``: the full-rank layers kept (``{"paper": {"keep": [...]}}``;
    None: the model class's own ``PRESETS``). ``defaults``: training settings applied when neither
    a config file nor a flag sets them (a value may be a function of the other values, as llama's
    LR of its width). ``check(cfg)``: raises ``ValueError`` in one line for a configuration the
    model cannot train. ``run_fields``: more configuration fields a resume may not change.
    ``defaults_note``: where the defaults come from (what was measured, at which sizes), shown
    by ``pufferfish train --help``. ``bench_optimizer``: what every ``pufferfish bench`` method steps it with (the bench times
    images on Fashion-MNIST, LMs on KJV token batches, by ``task``). ``factory``: the model
    class's own constructor, for :func:`~pufferfish.models.build_model` (None: ``build`` only).
    """

    name: str
    build: Callable[..., nn.Module]
    task: str = "image"
    batch_first: bool = True
    presets: Mapping[str, Mapping[str, Any]] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    defaults_note: str = ""
    check: Callable[[Any], None] | None = None
    run_fields: tuple[str, ...] = ()
    bench_optimizer: str = "sgd"
    factory: Callable[..., nn.Module] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASK_KINDS:
            raise ValueError(f"ModelSpec {self.name!r}: task {self.task!r} is invalid: allowed "
                             f"{', '.join(TASK_KINDS)}")
        if self.bench_optimizer not in BENCH_OPTIMIZERS:
            raise ValueError(f"ModelSpec {self.name!r}: bench_optimizer {self.bench_optimizer!r} "
                             f"is invalid: allowed {', '.join(BENCH_OPTIMIZERS)}")

    @property
    def is_lm(self) -> bool:
        """Whether it is a language model (trained on tokens, not images)."""
        return self.task != "image"

    def build_at(self, width: float, **shapes: Any) -> nn.Module:
        """The model at ``width``, carrying :attr:`presets` when the spec gives them."""
        model = self.build(width, **shapes)
        if self.presets is not None:
            model.PRESETS = {k: dict(v) for k, v in self.presets.items()}
        return model

    def sample_input(self, *, in_channels: int = 3, image_size: int = 32,
                     seq_len: int = 35) -> torch.Tensor:
        """One example input: an image batch of one, or ``seq_len`` tokens of one sequence."""
        if not self.is_lm:
            return torch.zeros(1, in_channels, image_size, image_size)
        shape = (1, seq_len) if self.batch_first else (seq_len, 1)
        return torch.zeros(shape, dtype=torch.long)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make ``spec`` a ``--model`` choice under its name (``replace``: over one of that name)."""
    if not spec.name or ":" in spec.name or "/" in spec.name:
        raise ValueError(f"model name {spec.name!r} is invalid: allowed a non-empty name "
                         "without ':' or '/'")
    if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"model {spec.name!r} is already registered: allowed a new name, or "
                         "replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def model_names() -> tuple[str, ...]:
    """The registered models' names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The spec of a registered model, or of a ``PATH.py:NAME`` / ``module:NAME`` reference;
    ``ValueError`` in one line naming what is allowed."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        spec = spec_of_reference(name)
        if spec is not None:
            return spec
        raise ValueError(f"model {name!r} is invalid: its NAME is not a "
                         "pufferfish.models.ModelSpec (allowed PATH.py:NAME or module:NAME of one)")
    raise ValueError(f"model {name!r} is invalid: allowed {', '.join(_REGISTRY)}, or your own "
                     "ModelSpec as PATH.py:NAME or module:NAME")


def absolute_reference(ref: str) -> str:
    """``PATH.py:NAME`` with ``PATH`` made absolute (a run's config.toml then names the same file
    wherever the run is resumed from); a registered name or ``module:NAME`` unchanged."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not (where.endswith(".py") or "/" in where or "\\" in where):
        return ref
    return f"{Path(where).expanduser().resolve()}:{attr}"


def spec_of_reference(ref: str) -> ModelSpec | None:
    """The ``ModelSpec`` that ``PATH.py:NAME`` or ``module:NAME`` names, or None when ``NAME`` is
    something else (the bench's ``Workload`` factories use the same form); ``ValueError`` when the
    file or module cannot be loaded or has no ``NAME``. Its name in runs is its own ``name``."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        return None
    found = getattr(import_reference(ref, where), attr, None)
    if found is None:
        raise ValueError(f"--model {ref!r}: {where} has no {attr!r}")
    return found if isinstance(found, ModelSpec) else None


def import_reference(ref: str, where: str) -> Any:
    """The module of ``PATH.py`` (loaded from the file once per process) or of ``package.module``
    (imported), for the ``--model`` reference ``ref``; ``ValueError`` in one line. The current
    folder (for ``package.module``) or the file's (for ``PATH.py``) joins the end of
    ``sys.path``, so that the factory's imports of its own project resolve from the
    ``pufferfish`` command too, as under ``python -m`` (which puts it first)."""
    if not (where.endswith(".py") or "/" in where or "\\" in where):
        _on_path(Path.cwd())
        try:
            return importlib.import_module(where)
        except Exception as e:
            raise ValueError(f"--model {ref!r}: cannot import {where!r} "
                             f"({type(e).__name__}: {e})") from None
    path = Path(where).expanduser()
    if not path.is_file():
        raise ValueError(f"--model {ref!r}: no file {str(path)!r} (allowed an existing "
                         "PATH.py:NAME, or package.module:NAME; the examples/ folder of "
                         "the repository is not in the wheel)")
    name = f"_pufferfish_workload_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    _on_path(path.resolve().parent)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--model {ref!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"--model {ref!r}: importing {str(path)!r} raised "
                         f"{type(e).__name__}: {e}") from None
    return module


def _on_path(folder: Path) -> None:
    """``folder`` at the end of ``sys.path`` unless there: last, so that nothing installed is
    shadowed by a file of the same name there."""
    if str(folder) not in sys.path and str(folder.resolve()) not in sys.path:
        sys.path.append(str(folder.resolve()))
