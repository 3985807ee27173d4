"""The registry of training methods (``--mode``), and the Pufferfish method itself.

``full`` trains the model as it is; ``pufferfish`` warms up full-rank and switches once (the
:class:`~pufferfish.Recipe`); ``lowrank`` is Pufferfish with no warm-up: the model is factorized
by SVD of its *initial* weights before the first step (the paper's "spectral initialization"
ablation). Baselines add their own modes with :func:`register_method` (``lth``, ``prune``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..config import TrainConfig
from ..lowrank import LowRankLSTM, factorize
from ..recipe import Recipe
from .method import Change, FullRank, Method

__all__ = ["PufferfishMethod", "build_method", "register_method"]

_METHODS: dict[str, Callable[[TrainConfig], Method]] = {}


def register_method(mode: str, factory: Callable[[TrainConfig], Method]) -> None:
    _METHODS[mode] = factory


def build_method(cfg: TrainConfig) -> Method:
    if cfg.mode not in _METHODS:
        from .. import baselines  # noqa: F401 -- registers the baseline modes

    if cfg.mode not in _METHODS:
        raise ValueError(f"mode {cfg.mode!r} is invalid: allowed {', '.join(sorted(_METHODS))}")
    return _METHODS[cfg.mode](cfg)


class PufferfishMethod(Method):
    """Full-rank warm-up, then one switch to the factorized model (see :mod:`pufferfish.recipe`)."""

    name = "pufferfish"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.recipe: Recipe | None = None
        self.ranks: dict[str, int] = {}  # of the factorized modules, to rebuild them on resume
        self.kernels: dict[str, bool] = {}  # LowRankLSTM name -> fused, likewise

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.recipe = Recipe(
            warmup_epochs=0 if cfg.mode == "lowrank" else cfg.warmup,
            rank_ratio=cfg.ratio,
            max_rank_ratio=cfg.max_rank_ratio,
            keep="auto" if cfg.keep_auto else cfg.keep,
            preset=None if cfg.preset == "none" else cfg.preset,
            keep_first=cfg.keep_first,
            extra_bn=cfg.extra_bn,
            example_input=example_input,
            min_warmup=cfg.min_warmup_epochs,
            max_warmup=cfg.max_warmup,
            switch_threshold=cfg.switch_threshold,
            switch_window=cfg.switch_window,
        )
        if self.recipe.detector is not None:
            self.recipe.observe(0, model)  # the stable ranks at initialization

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        assert self.recipe is not None
        if not self.recipe.should_switch(epoch, model):
            return None
        self.recipe.switch(epoch, model, None)
        report = self.recipe.report
        assert report is not None
        self.ranks = report.ranks
        self.kernels = {n: m.fused for n, m in model.named_modules() if isinstance(m, LowRankLSTM)}
        text = f"switching to the low-rank model at epoch {epoch}:\n{report}"
        decided = self.recipe.describe_decisions()
        return Change("factorization", text + ("\n" + decided if decided else ""),
                      {"epoch": epoch, **report.to_dict(), "decisions": self.recipe.decisions})

    def on_step_end(self, epoch: int, step: int, steps: int, model: nn.Module) -> None:
        # Between epoch ends, feed the switch detector every N steps so that its window (in
        # epochs) is covered by several observations even in short runs.
        recipe = self.recipe
        if recipe is None or recipe.warmup_epochs != "auto" or recipe.switched or step >= steps:
            return
        every = self.cfg.stable_rank_every_steps or max(1, steps // 4)
        if step % every == 0:
            recipe.observe(epoch + step / steps, model)

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        assert self.recipe is not None
        row: dict[str, Any] = {"switch_epoch": self.recipe.switched_at}
        detector = self.recipe.detector
        if detector is not None and not self.recipe.switched:
            row["stable_ranks"] = self.recipe.observe(epoch + 1, model)
            # how far from "settled" (switch_threshold) the slowest layer still is
            change = max((detector.smoothed_change(n) for n in row["stable_ranks"]), default=None)
            if change is not None and change != float("inf"):
                row["stable_rank_change"] = change
        return row

    def state_dict(self) -> dict[str, Any]:
        assert self.recipe is not None
        return {"recipe": self.recipe.state_dict(), "ranks": self.ranks, "kernels": self.kernels}

    def restore(self, state: dict[str, Any], model: nn.Module) -> None:
        assert self.recipe is not None
        if state["ranks"]:  # rebuild the exact factorized architecture
            factorize(model, include=list(state["ranks"]), overrides=state["ranks"],
                      rank_ratio=1.0, extra_bn=self.cfg.extra_bn)
        for name, fused in state.get("kernels", {}).items():
            model.get_submodule(name).fused = fused
        self.kernels = dict(state.get("kernels", {}))
        self.recipe.load_state_dict(state["recipe"], model)
        self.ranks = dict(state["ranks"])


register_method("full", FullRank)
register_method("pufferfish", PufferfishMethod)
register_method("lowrank", PufferfishMethod)
