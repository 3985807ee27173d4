"""The switch as a drop-in: the user's optimizer, LR scheduler and DDP wrapper keep working.

`Recipe.switch` edits the optimizer in place (`swap_parameters`), so every parameter group, its
hyperparameters and the LR schedule continue exactly; DDP is re-wrapped with every option and
comm hook of the user's wrapper (checked in a real 2-process gloo group); bad arguments fail when
the recipe is built, bad keep patterns at the first call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import report_to_parent, run_worker_pair
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import lr_scheduler

import pufferfish as pf
from pufferfish.distributed.env import ddp_options
from pufferfish.lowrank import LowRankModule


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _decay_groups(model: nn.Module, **second: Any) -> list[dict[str, Any]]:
    """The HF convention: weights decayed (group 0), biases not (group 1), per-group settings."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, **second}]


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


class SignMomentum(torch.optim.Optimizer):
    """A third-party optimizer in torch's style: a required lr, a per-group key of its own."""

    def __init__(self, params: Any, lr: float, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta, tag="mine"))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = state.setdefault("m", torch.zeros_like(p))
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(m.sign(), alpha=-group["lr"])


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd_nesterov": lambda m: torch.optim.SGD(_decay_groups(m, lr=0.05), lr=0.1, momentum=0.9,
                                              nesterov=True),
    "adam": lambda m: torch.optim.Adam(_decay_groups(m, betas=(0.8, 0.99)), lr=1e-3),
    "adamw": lambda m: torch.optim.AdamW(_decay_groups(m, lr=2e-3), lr=1e-3),
    "rmsprop": lambda m: torch.optim.RMSprop(_decay_groups(m, alpha=0.9), lr=1e-3, momentum=0.5),
    "adagrad": lambda m: torch.optim.Adagrad(_decay_groups(m, lr_decay=1e-3), lr=1e-2),
    "third_party": lambda m: SignMomentum(_decay_groups(m, lr=2e-3, tag="biases"), lr=1e-3),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_switch_keeps_the_optimizer_and_its_groups(name: str) -> None:
    model = _mlp()
    opt = OPTIMIZERS[name](model)
    _step(model, opt)
    groups, hyper = opt.param_groups, [{k: v for k, v in g.items() if k != "params"}
                                       for g in opt.param_groups]
    hyper = copy.deepcopy(hyper)
    kept, replaced = model[0].weight, [model[2].weight, model[2].bias, model[4].weight]
    kept_state = opt.state[kept]
    recipe = pf.Recipe(warmup_epochs=0, rank_ratio=0.25, keep=["0"])
    model, new, _ = recipe.on_epoch_start(0, model, opt)

    assert new is opt and type(new) is type(opt) and new.param_groups is groups
    assert [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups] == hyper
    low = [m for m in model.modules() if isinstance(m, LowRankModule)]
    assert len(low) == 2
    in_group = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    for module in low:  # factors where the dense weight was, biases where the bias was
        for p in module.parameters():
            assert in_group[id(p)] == (0 if p.dim() >= 2 else 1)
    assert sorted(in_group) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert all(p not in opt.state for p in replaced)  # momentum reset for replaced weights
    assert kept_state and kept not in opt.state  # and for survivors: all empty, as the CLI's
    assert recipe.parameter_swap is not None and not recipe.parameter_swap.notes

    factors = [p.detach().clone() for m in low for p in m.parameters()]
    _step(model, opt, seed=1)
    after = [p for m in low for p in m.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(factors, after, strict=True))
    assert all(p in opt.state for p in after)


def test_lbfgs_is_reset_and_keeps_working() -> None:
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, history_size=3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    model, opt2, _ = pf.Recipe(warmup_epochs=0, keep=["0"]).on_epoch_start(0, model, opt)
    assert opt2 is opt and not opt.state
    opt.step(closure)  # its flattened history would no longer fit the parameters
    assert opt._params is opt.param_groups[0]["params"]


def test_new_parameter_without_a_predecessor_is_reported() -> None:
    model = nn.Sequential(nn.Conv2d(8, 16, 3, bias=False), nn.Conv2d(16, 16, 3, bias=False))
    opt = torch.optim.SGD(_decay_groups(model), lr=0.1)
    recipe = pf.Recipe(warmup_epochs=0, rank_ratio=0.25, extra_bn=True, keep=["0"])
    model, opt, _ = recipe.on_epoch_start(0, model, opt)
    swap = recipe.parameter_swap
    assert swap is not None and swap.removed == ["1.weight"]
    # The BatchNorm between the factors: no bias before, so it joins the conv weight's group.
    assert swap.added["1.bn.weight"] == 0 and swap.added["1.bn.bias"] == 0
    assert any(note.startswith("1.bn.weight: no replaced vector") for note in swap.notes)
    assert "1.bn.weight" in str(swap)


def test_swap_leaves_out_what_was_not_optimized() -> None:
    model = _mlp()
    opt = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=0.1)
    before = dict(model.named_parameters(remove_duplicate=False))
    pf.factorize(model, rank_ratio=0.25, keep=["0"])
    swap = pf.swap_parameters(opt, before, dict(model.named_parameters(remove_duplicate=False)))
    assert {id(p) for p in opt.param_groups[0]["params"]} == (
        {id(p) for p in model[0].parameters()} | {id(p) for p in model[2].parameters()})
    assert not any(n.startswith("4.") for n in swap.added)
    assert any(n.startswith("4.") and "left out" in n for n in swap.notes)


# ---------------------------------------------------------------------------------------------
# LR schedules: the same sequence with and without the switch
# ---------------------------------------------------------------------------------------------

STEPS, SWITCH = 12, 5


def _hf(name: str) -> Callable[[torch.optim.Optimizer], Any]:
    def build(opt: torch.optim.Optimizer) -> Any:
        transformers = pytest.importorskip("transformers")
        return getattr(transformers, name)(opt, num_warmup_steps=3, num_training_steps=STEPS)
    return build


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "multistep": lambda o: lr_scheduler.MultiStepLR(o, milestones=[2, 6, 9], gamma=0.5),
    "cosine": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    "warm_restarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2),
    "linear": lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=9),
    "sequential": lambda o: lr_scheduler.SequentialLR(o, [
        lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
        lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 4)], milestones=[4]),
    "chained": lambda o: lr_scheduler.ChainedScheduler([
        lr_scheduler.ExponentialLR(o, gamma=0.9), lr_scheduler.StepLR(o, step_size=4, gamma=0.5)]),
    "one_cycle": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2], total_steps=STEPS),
    "lambda_two_groups": lambda o: lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s,
                                                             lambda s: 1 / (1 + s)]),
    "plateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1),
    "hf_linear_warmup": _hf("get_linear_schedule_with_warmup"),
    "hf_cosine_warmup": _hf("get_cosine_schedule_with_warmup"),
}


def _lr_sequence(make: Callable[[torch.optim.Optimizer], Any], switch: bool) -> list[list[float]]:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(_decay_groups(model, lr=2e-3), lr=1e-3)
    scheduler = make(opt)
    recipe = pf.Recipe(warmup_epochs=SWITCH, rank_ratio=0.25)
    seen = []
    for step in range(STEPS):
        if switch:
            model, opt2, scheduler2 = recipe.on_epoch_start(step, model, opt, scheduler)
            assert opt2 is opt and scheduler2 is scheduler
        _step(model, opt, seed=step)
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step([3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0][step])
        else:
            scheduler.step()
        seen.append([g["lr"] for g in opt.param_groups])
    assert recipe.switched == switch
    return seen


@pytest.mark.parametrize("name", SCHEDULERS)
def test_lr_schedule_is_unchanged_by_the_switch(name: str) -> None:
    without = _lr_sequence(SCHEDULERS[name], switch=False)
    with_switch = _lr_sequence(SCHEDULERS[name], switch=True)
    assert with_switch == without
    # the schedule really moves after the switch (a frozen LR would not pass)
    assert len({tuple(lrs) for lrs in without[SWITCH:]}) > 1


# ---------------------------------------------------------------------------------------------
# Arguments checked early
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank_ratio": 0}, "rank_ratio 0 is invalid: allowed a number in (0, 1] or 'auto'"),
    ({"rank_ratio": 1.5}, "rank_ratio 1.5 is invalid"),
    ({"rank_ratio": "half"}, "rank_ratio 'half' is invalid"),
    ({"max_rank_ratio": 0.0}, "max_rank_ratio 0.0 is invalid: allowed a number in (0, 1] or None"),
    ({"warmup_epochs": -1}, "warmup_epochs -1 is invalid: allowed an integer >= 0 or 'auto'"),
    ({"warmup_epochs": 1.5}, "warmup_epochs 1.5 is invalid"),
    ({"keep": [3]}, "keep [3] is invalid: allowed 'auto', a glob pattern or a list"),
    ({"keep": 3}, "keep 3 is invalid"),
    ({"keep": "auto"}, "keep='auto' needs an example_input"),
    ({"keep_first": -1}, "keep_first -1 is invalid: allowed an integer >= 0"),
    ({"preset": 1}, "preset 1 is invalid"),
    ({"extra_bn": "yes"}, "extra_bn 'yes' is invalid: allowed True or False"),
    ({"on_wrap": 1}, "on_wrap 1 is invalid: allowed a callable"),
    ({"min_warmup": -1}, "min_warmup -1 is invalid"),
    ({"warmup_epochs": "auto", "min_warmup": 3, "max_warmup": 2},
     "max_warmup 2 is invalid: allowed None or a number of epochs >= min_warmup (3)"),
    ({"max_warmup": "2"}, "max_warmup '2' is invalid"),
    ({"switch_threshold": -0.1}, "switch_threshold -0.1 is invalid: allowed a number >= 0"),
    ({"switch_window": 0}, "switch_window 0 is invalid: allowed a number of epochs > 0"),
])
def test_bad_arguments_fail_when_the_recipe_is_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=_literal(message)):
        pf.Recipe(**kwargs)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("kwargs", [{"keep": ["nosuch.*"]}, {"preset": "paper"}])
@pytest.mark.parametrize("first_call", ["on_epoch_start", "observe"])
def test_bad_keep_patterns_fail_at_the_first_call(kwargs: dict[str, Any], first_call: str) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = pf.Recipe(warmup_epochs=10, **kwargs)  # the switch would come much later
    expected = "matches no module" if "keep" in kwargs else "has no preset 'paper'"
    with pytest.raises(ValueError, match=expected):
        if first_call == "observe":
            recipe.observe(0, model)
        else:
            recipe.on_epoch_start(0, model, opt)
    assert not recipe.switched and type(model[2]) is nn.Linear


# ---------------------------------------------------------------------------------------------
# DDP: a real 2-process gloo group
# ---------------------------------------------------------------------------------------------

class _WithUnused(nn.Module):
    """A model with a layer the forward pass never uses: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.bn = nn.BatchNorm1d(32)
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.body(x)).relu())


def _counting_allreduce(state, bucket):  # unannotated: DDP checks real annotations, not strings
    state["calls"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def _ddp_run(rank: int, ddp_kwargs: dict[str, Any], hook: str,
             on_wrap: Callable[[DDP], Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(rank)  # different initial weights and data: DDP must make them agree
    model = _WithUnused()
    ddp = DDP(model, **ddp_kwargs)
    state: Any = None
    if hook == "counting":
        state = {"calls": 0}
        ddp.register_comm_hook(state, _counting_allreduce)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif hook == "topk":
        from pufferfish.distributed.hooks import register_comm_hook

        state = register_comm_hook(ddp, "topk", ratio=0.25)
    opt = torch.optim.AdamW(_decay_groups(model), lr=1e-2)
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio=0.25, on_wrap=on_wrap)
    out: dict[str, Any] = {}
    old_options = ddp_options(ddp)
    for epoch in range(2):
        if epoch == 1:
            calls_before = _hook_calls(state)
            bn_before = model.bn.running_mean.clone()
            ddp, opt2, _ = recipe.on_epoch_start(epoch, ddp, opt)
            out["same_optimizer"] = opt2 is opt
            out["new_wrapper"] = isinstance(ddp, DDP)
            out["options_kept"] = ddp_options(ddp) == old_options
            out["find_unused"] = ddp.find_unused_parameters
            out["static_graph"] = ddp.static_graph
            out["gradient_as_bucket_view"] = ddp.gradient_as_bucket_view
            out["bucket_bytes_cap"] = ddp.bucket_bytes_cap
            out["buffers_kept"] = torch.equal(model.bn.running_mean, bn_before)
        else:
            recipe.on_epoch_start(epoch, ddp, opt)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * epoch + step + 7 * rank)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    out["hook_calls_after"] = _hook_calls(state) - calls_before
    out["lowrank"] = type(model.body[2]).__name__
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    out["replica_gap"] = (both[0] - both[1]).abs().max().item()
    if hook == "powersgd":
        out["powersgd_iter"] = state.iter
    return out


def _hook_calls(state: Any) -> int:
    if isinstance(state, dict):
        return state["calls"]
    if hasattr(state, "stats"):
        return state.stats.buckets
    return getattr(state, "iter", 0)


def _on_wrap_topk(ddp: DDP) -> None:
    from pufferfish.distributed.hooks import register_comm_hook

    register_comm_hook(ddp, "topk", ratio=0.5)


def _mixed_precision_rewrap() -> dict[str, Any]:
    """Construction only: DDP's mixed precision needs CUDA events for a forward pass."""
    from torch.nn.parallel.distributed import _MixedPrecision

    from pufferfish.distributed.env import rewrap_ddp

    model = _mlp()
    ddp = DDP(model, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))

    def hooks() -> tuple[int, int]:
        return len(ddp._comm_hooks), sum(len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    old, ddp = ddp, rewrap_ddp(ddp)
    return {"options_kept": ddp_options(ddp) == ddp_options(old), "hooks": (before, hooks()),
            "mixed_precision": ddp.mixed_precision == old.mixed_precision}


def _switch_unwrapped(rank: int) -> dict[str, Any]:
    """A model without a wrapper, different on each rank (an ensemble, a pipeline stage): the
    switch communicates nothing, each rank keeps its own factors (a DDP wrapper's construction
    broadcasts rank 0's; FSDP2's switch broadcasts them itself)."""
    torch.manual_seed(rank)
    model = _mlp()
    mine = pf.Recipe(warmup_epochs=1, rank_ratio=0.25).switch(1, model, None)[0]
    flat = torch.cat([p.detach().flatten() for p in mine.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return {"replica_gap": (both[0] - both[1]).abs().max().item(),
            "lowrank": sum(isinstance(m, LowRankModule) for m in mine.modules())}


def _compiled_ddp(rank: int) -> dict[str, Any]:
    """``torch.compile(DDP(model))`` (torch's order; Accelerate's with a dynamo backend): the
    switch factorizes the module under both wrappers and rebuilds the DDP in place, so the new
    factors' gradients are averaged and the replicas stay equal."""
    torch.manual_seed(0)
    model = _mlp()
    compiled = torch.compile(DDP(model), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = pf.Recipe(warmup_epochs=1, rank_ratio=0.25)
    same = None
    for epoch in range(2):
        out, opt, _ = recipe.on_epoch_start(epoch, compiled, opt)
        same = out is compiled if epoch == 1 else same
        for step in range(3):
            g = torch.Generator().manual_seed(100 * epoch + step + 7 * rank)  # data differs
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return {"same_wrapper": same, "replica_gap": (both[0] - both[1]).abs().max().item(),
            "lowrank": sum(isinstance(m, LowRankModule) for m in model.modules())}


def _fsdp1_refused() -> dict[str, Any]:
    """A trainer's FSDP1 wrapper (flat, per-rank shards of different sizes): the integrations'
    start check refuses it in one line instead of a switch that fails on some ranks only."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from pufferfish.integrations.core import check_wrapper

    wrapped = FSDP(_mlp(), use_orig_params=True, device_id=torch.device("cpu"))
    try:
        check_wrapper(wrapped)
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def _ddp_worker(rank: int, port: int, queue: Any) -> None:
    def work() -> dict[str, Any]:
        return {
            "options": _ddp_run(rank, dict(find_unused_parameters=True, broadcast_buffers=False,
                                           gradient_as_bucket_view=True, bucket_cap_mb=1),
                                hook="counting"),
            "static_powersgd": _ddp_run(rank, dict(static_graph=True), hook="powersgd"),
            "topk": _ddp_run(rank, dict(find_unused_parameters=True), hook="topk"),
            "on_wrap": _ddp_run(rank, dict(find_unused_parameters=True), hook="topk",
                                on_wrap=_on_wrap_topk),
            "mixed_precision": _mixed_precision_rewrap(),
            "unwrapped": _switch_unwrapped(rank),
            "compiled": _compiled_ddp(rank),
            "fsdp1": _fsdp1_refused(),
        }
    report_to_parent(rank, port, queue, work)


@pytest.fixture(scope="module")
def ddp_results() -> dict[int, Any]:
    return run_worker_pair(_ddp_worker)


def test_ddp_rewrap_keeps_every_option_and_the_comm_hook(ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = ddp_results[rank]["options"]
        assert r["same_optimizer"] and r["new_wrapper"] and r["options_kept"]
        assert r["find_unused"] and r["gradient_as_bucket_view"] and not r["static_graph"]
        assert r["bucket_bytes_cap"] == 1024 * 1024
        # broadcast_buffers=False: each rank's BatchNorm statistics stay its own at the re-wrap
        assert r["buffers_kept"]
        assert r["hook_calls_after"] >= 3  # the user's hook runs on the new wrapper
        assert r["lowrank"] == "LowRankLinear"
        assert r["replica_gap"] == 0.0  # three steps with an unused layer, replicas identical


def test_ddp_rewrap_static_graph_and_powersgd(ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = ddp_results[rank]["static_powersgd"]
        assert r["options_kept"] and r["static_graph"] and r["replica_gap"] == 0.0
        # torch's PowerSGD memory is keyed by bucket: cleared, its warm-up restarted, then on
        assert r["powersgd_iter"] == 3


def test_ddp_rewrap_reuses_pufferfish_hook_state_or_calls_on_wrap(
        ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        for case in ("topk", "on_wrap"):
            r = ddp_results[rank][case]
            assert r["options_kept"] and r["find_unused"] and r["replica_gap"] == 0.0
        assert ddp_results[rank]["topk"]["hook_calls_after"] >= 3  # the same state, still in use
        assert ddp_results[rank]["on_wrap"]["hook_calls_after"] == 0  # on_wrap's hook instead


def test_ddp_rewrap_mixed_precision_is_set_up_once(ddp_results: dict[int, Any]) -> None:
    r = ddp_results[0]["mixed_precision"]
    assert r["options_kept"] and r["mixed_precision"]
    before, after = r["hooks"]
    assert before == after  # DDP's own upcast comm hook and copy hooks, not twice


def test_a_model_no_wrapper_replicates_keeps_each_rank_s_own_factors(
        ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = ddp_results[rank]["unwrapped"]
        assert r["lowrank"] >= 1 and r["replica_gap"] > 0.1


def test_a_compiled_ddp_is_rebuilt_in_place_and_its_replicas_stay_equal(
        ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        r = ddp_results[rank]["compiled"]
        assert r["same_wrapper"] and r["lowrank"] >= 1 and r["replica_gap"] == 0.0


def test_fsdp1_is_refused_in_one_line_before_the_switch(ddp_results: dict[int, Any]) -> None:
    for rank in (0, 1):
        said = ddp_results[rank]["fsdp1"]["refused"]
        assert said is not None and "\n" not in said
        assert said.startswith("a model wrapped by FullyShardedDataParallel is invalid for the "
                               "Pufferfish switch") and "allowed DDP, FSDP2's fully_shard" in said


def test_swap_follows_a_tied_weight_by_name() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight  # tied: one tensor under two names
    opt = torch.optim.SGD(_decay_groups(model), lr=0.1, momentum=0.9)
    _step_on(model, opt)
    tied_state = opt.state[model[0].weight]
    before = dict(model.named_parameters(remove_duplicate=False))
    model[1] = nn.Sequential(nn.Linear(32, 4, bias=False), nn.Linear(4, 32))  # "factorized"
    swap = pf.swap_parameters(opt, before, dict(model.named_parameters(remove_duplicate=False)))
    assert swap.added == {"1.0.weight": 0, "1.1.weight": 0, "1.1.bias": 1} and not swap.notes
    assert swap.removed == ["1.bias"]  # the tied weight lives on in model[0]
    assert opt.state[model[0].weight] is tied_state


def _step_on(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()


def test_first_call_check_is_silent_on_a_good_model(recwarn: pytest.WarningsRecorder) -> None:
    """The dry-run factorize that checks keep patterns changes nothing on purpose: no warning."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = pf.Recipe(warmup_epochs=1, keep=["2"])
    recipe.on_epoch_start(0, model, opt)
    assert not [w for w in recwarn if "changed nothing" in str(w.message)]
