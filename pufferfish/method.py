"""The package's own training methods for the loop: full rank, and Pufferfish.

:class:`PufferfishMethod` adapts the one :class:`~pufferfish.switch.Switch` (when and how to
factorize, and the record of both) to the loop's :class:`~pufferfish.training.methods.Method`
interface, and adds what else low-rank training needs from the loop: Frobenius decay on the factor
pairs (a loss term, and the factors' own optimizer group without plain weight decay) and the
low-rank figures of the metrics rows. The loop itself knows nothing of low rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .auto import frobenius_decay, frobenius_decay_params
from .config import ConfigError, TrainConfig
from .lowrank import LowRankModule, count_macs
from .switch import FactorizationPlan, Switch, SwitchPolicy, projected_state
from .training.methods.base import Change, Method

__all__ = ["FullRankMethod", "PufferfishMethod"]


class FullRankMethod(Method):
    """Full-rank training: the model as it is. The figures count MACs and say whether the model
    holds low-rank layers; the pruning baselines build on this too."""

    name = "full"

    def model_figures(self, model: nn.Module, example_input: Any) -> dict[str, Any]:
        base = super().model_figures(model, example_input)
        return {"params": base["params"],
                "macs": count_macs(model, example_input),  # per example
                "lowrank": any(isinstance(m, LowRankModule) for m in model.modules()),
                **base}


class PufferfishMethod(FullRankMethod):
    """Full-rank warm-up, then one switch to the factorized model (``--mode lowrank``: no
    warm-up, the initial weights' SVD: the paper's "spectral initialization")."""

    name = "pufferfish"
    run_fields = ("mode", "warmup_epochs", "warmup_steps", "rank_ratio", "preset", "keep",
                  "keep_first", "extra_bn", "switch_momentum", "switch_lr_warmup")

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.switch = Switch(
            SwitchPolicy(0 if cfg.mode == "lowrank" else cfg.switch_epoch,
                         track=cfg.ratio == "auto", earliest=cfg.min_warmup_epochs,
                         latest=cfg.latest_auto_switch, threshold=cfg.switch_threshold,
                         window=cfg.switch_window),
            FactorizationPlan(cfg.ratio, "auto" if cfg.keep_auto else cfg.keep,
                              max_rank_ratio=cfg.max_rank_ratio,
                              preset=None if cfg.preset == "none" else cfg.preset,
                              keep_first=cfg.keep_first, extra_bn=cfg.extra_bn,
                              kernel=cfg.kernel))

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.switch.plan.example_input = example_input
        self.switch.observe(0, model)  # checks the plan; automatic: the stable ranks at init

    @property
    def in_steps(self) -> bool:
        """Whether the switch point is in optimizer steps (``warmup_steps``, or a share warm-up of
        a 1-epoch run), not epochs."""
        return self.cfg.mode == "pufferfish" and self.cfg.switch_step(1) is not None

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        if self.in_steps or not self.switch.due(epoch, model):
            return None
        return self._switch(epoch, model, f"epoch {epoch}", {})

    def on_step_start(self, epoch: int, step: int, steps: int, model: nn.Module) -> Change | None:
        """``warmup_steps``: the switch before global step ``cfg.switch_step`` (mid-epoch); under
        DiLoCo before the first step from there that follows an outer step (synchronized weights:
        every ``inner_steps`` steps and at each epoch's start)."""
        if not self.in_steps or self.switch.switched:
            return None
        total = self.cfg.epochs * steps
        at = self._step_switch(steps)
        if at is None or at >= total:
            given = (f"warmup_steps {self.cfg.warmup_steps:g}" if self.cfg.warmup_steps else
                     f"warmup_epochs {self.cfg.warmup_epochs} (step {at})")
            raise ConfigError(f"{given} is invalid with "
                              f"{total} optimizer steps in the run: allowed a switch before the "
                              "last step" + (" (under DiLoCo, on an outer step)"
                                             if self.cfg.sync == "diloco" else ""))
        global_step = epoch * steps + step
        if global_step < at:
            return None
        return self._switch(epoch, model, f"step {global_step} (epoch {epoch}, step {step})",
                            {"step": global_step})

    def _step_switch(self, steps: int) -> int | None:
        """``warmup_steps``' switch step (under DiLoCo the next outer step from there)."""
        at = self.cfg.switch_step(self.cfg.epochs * steps)
        if at is not None and self.cfg.sync == "diloco":
            h = self.cfg.inner_steps
            at = min(-(-at // h) * h, -(-at // steps) * steps)
        return at

    def lr_scale(self, global_step: int, steps_per_epoch: int) -> float:
        """The LR re-warm-up after the switch (``cfg.switch_lr_rewarm``: ``switch_lr_warmup``,
        or ``switch_momentum`` auto's): the LR ramps linearly from 1/W of the schedule's back
        to it over W steps, as ReLoRA does after each of its resets: the factors (and, with
        ``reset``, Adam's fresh moments) start with small steps."""
        if not self.switch.switched or self.cfg.mode != "pufferfish":
            return 1.0
        at = (self._step_switch(steps_per_epoch) if self.in_steps else
              int(self.switch.policy.switched_at or 0) * steps_per_epoch) or 0
        ramp = self.cfg.switch_lr_rewarm(at, steps_per_epoch)
        if ramp <= 0:
            return 1.0
        total = self.cfg.epochs * steps_per_epoch
        width = max(1, round(ramp * total) if ramp < 1 else int(ramp))
        since = global_step - at
        return 1.0 if since >= width else (max(0, since) + 1) / width

    def _switch(self, epoch: int, model: nn.Module, when: str,
                record: dict[str, Any]) -> Change:
        report = self.switch.switch(epoch, model)
        text = f"switching to the low-rank model at {when}:\n{report}"
        decided = self.switch.describe()
        return Change("factorization", text + ("\n" + decided if decided else ""),
                      {"epoch": epoch, **record, **report.to_dict(),
                       "decisions": self.switch.plan.decisions})

    def carry_state(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                    before: dict[str, torch.Tensor], model: nn.Module) -> None:
        """``switch_momentum = "project"``: every parameter that survives the switch keeps its
        optimizer state, and each low-rank layer's factors get the state of the dense weights
        they replace, projected (:func:`~pufferfish.switch.projected_state`: SGD's momentum and
        Adam's first moment by the chain rule, Adam's second moment through the squared factors,
        Adam's step count kept). ``"reset"`` (the paper): nothing carried, every parameter
        starts with empty state (Adam: moments zero, bias correction from step 0)."""
        if self.cfg.switch_state == "project":
            _carry_projected(old, new, before, model)

    def carry_outer_state(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                          before: dict[str, torch.Tensor], model: nn.Module) -> None:
        """DiLoCo's outer Nesterov momentum across the switch: ``outer_switch_momentum``
        ``"project"`` carries it onto the factors as :meth:`carry_state` does the inner
        momentum; ``"reset"`` restarts it from zero."""
        if self.cfg.outer_switch_momentum == "project":
            _carry_projected(old, new, before, model)

    def on_step_end(self, epoch: int, step: int, steps: int, model: nn.Module) -> None:
        # Between epoch ends, feed the switch detector every N steps so that its window (in
        # epochs) is covered by several observations even in short runs.
        if self.switch.policy.warmup_epochs != "auto" or self.switch.switched:
            return
        if epoch == 0 and step == 1:  # the cap may depend on the steps per epoch
            self.switch.policy.cap(self.cfg.auto_switch_cap(steps))
        if step >= steps:
            return
        every = self.cfg.stable_rank_every_steps or max(1, steps // 4)
        if step % every == 0:
            self.switch.observe(epoch + step / steps, model)

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        """Under Frobenius decay the factor pairs go without plain weight decay."""
        if cfg.frobenius_decay <= 0:
            return super().param_groups(model, cfg)

        factors = {id(p) for p in frobenius_decay_params(model)}
        rest = [p for p in model.parameters() if id(p) not in factors]
        return [{"params": rest, "weight_decay": cfg.weight_decay},
                {"params": [p for p in model.parameters() if id(p) in factors],
                 "weight_decay": 0.0}]

    def extra_loss(self, model: nn.Module) -> torch.Tensor | None:
        if self.cfg.frobenius_decay <= 0:
            return None

        return frobenius_decay(model, self.cfg.frobenius_decay)

    def on_epoch_end(self, epoch: int, model: nn.Module) -> dict[str, Any]:
        row: dict[str, Any] = {"switch_epoch": self.switch.policy.switched_at}
        detector = self.switch.policy.detector
        if detector is not None and not self.switch.switched:
            row["stable_ranks"] = self.switch.observe(epoch + 1, model)
            # how far from "settled" (switch_threshold) the slowest layer still is
            change = max((detector.smoothed_change(n) for n in row["stable_ranks"]), default=None)
            if change is not None and change != float("inf"):
                row["stable_rank_change"] = change
        return row

    def state_dict(self) -> dict[str, Any]:
        return self.switch.state_dict()

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        self.switch.load_state_dict(state, model)
        self.switch.plan.rebuild(model)  # the exact factorized architecture


def _carry_projected(old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                     before: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Survivors keep their optimizer state in ``new``; each factor gets its dense weight's
    state projected (:func:`~pufferfish.switch.projected_state`)."""
    for p in model.parameters():
        if p in old.state:
            new.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in old.state[p].items()}
    for p, entry in projected_state(old.state, before, model).items():
        new.state[p] = entry
