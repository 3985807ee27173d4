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
from .switch import FactorizationPlan, Switch, SwitchPolicy, SwitchSchedule, carry_state
from .training.methods.base import Change, Method
from .training.precision import amp_dtype

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
        self.schedule = SwitchSchedule.from_config(cfg)  # every rule of when, and the carry
        self.switch = Switch(
            SwitchPolicy(self.schedule, track=cfg.ratio == "auto",
                         threshold=cfg.switch_threshold, window=cfg.switch_window),
            FactorizationPlan(cfg.ratio, "auto" if cfg.keep_auto else cfg.keep,
                              max_rank_ratio=cfg.max_rank_ratio,
                              preset=None if cfg.preset == "none" else cfg.preset,
                              keep_first=cfg.keep_first, extra_bn=cfg.extra_bn,
                              kernel=cfg.kernel))

    def setup(self, model: nn.Module, example_input: Any, cfg: TrainConfig) -> None:
        self.switch.plan.example_input = example_input
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.switch.plan.amp_dtype = amp_dtype(cfg, device)  # layers timed as they train
        self.switch.observe(0, model)  # checks the plan; automatic: the stable ranks at init

    def start_text(self, steps_per_epoch: int) -> str | None:
        return self.schedule.describe(steps_per_epoch)

    def on_epoch_start(self, epoch: int, model: nn.Module) -> Change | None:
        if not self.switch.due(epoch, model):
            return None
        return self._switch(epoch, model, f"epoch {epoch}", {})

    def check_steps(self, steps_per_epoch: int) -> None:
        """A switch in steps must fall before the run's last optimizer step."""
        if not self.schedule.in_steps or self.switch.switched:
            return
        total = self.cfg.epochs * steps_per_epoch
        at = self.schedule.switch_step(steps_per_epoch)
        if at is None or at >= total:
            given = (f"warmup_steps {self.cfg.warmup_steps:g}" if self.cfg.warmup_steps else
                     f"warmup_epochs {self.cfg.warmup_epochs} (step {at})")
            raise ConfigError(f"{given} is invalid with "
                              f"{total} optimizer steps in the run: allowed a switch before the "
                              "last step" + (" (under DiLoCo, on an outer step)"
                                             if self.cfg.sync == "diloco" else ""))

    def on_step_start(self, epoch: int, step: int, steps: int, model: nn.Module) -> Change | None:
        """A switch in steps (``warmup_steps``, a share of a 1-epoch run), mid-epoch, where the
        schedule puts it (:meth:`~pufferfish.switch.SwitchSchedule.switch_step`)."""
        if not self.schedule.in_steps or self.switch.switched:
            return None
        self.check_steps(steps)
        global_step = epoch * steps + step
        if not self.schedule.due_at_step(global_step, steps):
            return None
        return self._switch(epoch, model, f"step {global_step} (epoch {epoch}, step {step})",
                            {"step": global_step})

    def lr_scale(self, global_step: int, steps_per_epoch: int) -> float:
        """The schedule's LR re-warm-up after the switch
        (:meth:`~pufferfish.switch.SwitchSchedule.lr_scale`)."""
        if not self.switch.switched:
            return 1.0
        at = (self.schedule.switch_step(steps_per_epoch) if self.schedule.in_steps else
              int(self.switch.policy.switched_at or 0) * steps_per_epoch) or 0
        return self.schedule.lr_scale(global_step, at, steps_per_epoch)

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
        """The fresh optimizer starts with what :func:`~pufferfish.switch.carry_state` says for
        ``switch_momentum`` (reset/auto: nothing; project: survivors' state, factors' projected)."""
        new.state.update(carry_state(old.state, before, model, self.schedule.carry))

    def carry_outer_state(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                          before: dict[str, torch.Tensor], model: nn.Module) -> None:
        """DiLoCo's outer Nesterov momentum across the switch, by the same rule
        (``outer_switch_momentum``: ``reset`` restarts it from zero, ``project`` carries it)."""
        new.state.update(carry_state(old.state, before, model, self.cfg.outer_switch_momentum))

    def on_step_end(self, epoch: int, step: int, steps: int, model: nn.Module) -> None:
        # Between epoch ends, feed the switch detector as often as the schedule says, so that
        # its window (in epochs) is covered by several observations even in short runs.
        if not self.schedule.auto or self.switch.switched:
            return
        if epoch == 0 and step == 1:  # the cap may depend on the steps per epoch
            self.switch.policy.cap(steps)
        if step < steps and step % self.schedule.observe_every(steps) == 0:
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

