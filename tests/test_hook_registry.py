"""The comm-hook registry: a hook family is one file that registers itself, and every place that
offers hooks (make_comm_hook, the training config, the bench) reads the registry; each state class
rejects a bad setting with a one-line message naming the value and what is allowed.

The example family also runs by name in a real 2-process gloo group; the built-in hooks' behaviour
in DDP is tested in test_comm_hooks.py.
"""

# NOTE: no ``from __future__ import annotations``: DDP checks a hook's annotations as objects.

import copy
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from pufferfish.bench.methods import BENCH_METHODS as METHODS
from pufferfish.bench.projection import ALLGATHER_METHODS
from pufferfish.bench.runner import BenchConfig
from pufferfish.config import ConfigError, TrainConfig
from pufferfish.configfile import FIELDS, field_kind, load_config
from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.distributed.hooks import (
    HOOK_NAMES,
    CommHookState,
    HookFamily,
    HookOption,
    PowerSGDHookState,
    SignumState,
    TopKState,
    hook_family,
    hook_names,
    hook_options,
    make_comm_hook,
    register_comm_hook,
    register_hook_family,
    registry,
)


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Families registered by a test are forgotten after it."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))


# --- what a new hook file contains (docs/design.md, "How to add a comm hook") ----------------

LIMIT = HookOption("clip_limit", "limit", float, 1.0, "a number > 0", lambda v: v > 0,
                   help="entries of the averaged gradient are clipped to [-limit, limit]")


class ClippedState(CommHookState):
    """Averaging all-reduce, then each entry clipped to ``[-limit, limit]``."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, limit: float = 1.0) -> None:
        super().__init__(process_group)
        LIMIT.check(limit, "limit")
        self.limit = float(limit)

    def _options(self) -> dict[str, Any]:
        return {"limit": self.limit}


def clipped_hook(
    state: ClippedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    fut = default_hooks.allreduce_hook(state.group(), bucket)
    return fut.then(lambda f: f.value().clamp_(-state.limit, state.limit))


def _register_clipped() -> HookFamily:
    return register_hook_family(HookFamily("clipped", ClippedState, clipped_hook, options=(LIMIT,)))


def _clipped_worker(rank: int, init_file: str, out_dir: str) -> None:
    """One backward through DDP with the example hook, registered by name, vs the clipped mean."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    finished = False
    try:
        _register_clipped()  # what importing the hook's file does
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        reference = copy.deepcopy(model)
        ddp = DDP(model)
        state = register_comm_hook(ddp, "clipped", limit=0.5)
        x = torch.full((2, 4), float(rank + 1))
        ddp(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        means = [p.grad.clone() for p in reference.parameters()]
        for g in means:
            dist.all_reduce(g)
            g.div_(2)
        gap = max((p.grad - g.clamp(-0.5, 0.5)).abs().max().item()
                  for p, g in zip(model.parameters(), means))
        result = {"gap": gap, "largest_mean": max(g.abs().max().item() for g in means),
                  "state": type(state).__name__}
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        finished = True
    finally:
        cleanup(drain=finished)
    exit_process(0)  # no interpreter shutdown after a group (pufferfish.distributed.env)


# --- tests ------------------------------------------------------------------------------------


def test_the_example_hook_runs_by_name_in_a_real_group(tmp_path: Path) -> None:
    mp.spawn(_clipped_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["state"] == "ClippedState"
        assert result["largest_mean"] > 0.5  # the clipping did something
        assert result["gap"] < 1e-5  # (a + b) / 2 vs a / 2 + b / 2: rounding only


def test_a_hook_registered_in_one_file_is_offered_by_name(clean_registry: None) -> None:
    with pytest.raises(ConfigError, match="comm 'clipped' is invalid: allowed allreduce, fp16"):
        TrainConfig(comm="clipped")
    family = _register_clipped()
    assert hook_names()[-1] == "clipped" and hook_family("clipped") is family
    state, hook = make_comm_hook("clipped", limit=0.5)
    assert isinstance(state, ClippedState) and state.limit == 0.5 and hook is clipped_hook
    assert state.fresh().limit == 0.5
    assert TrainConfig(comm="clipped").comm == "clipped"  # config validation reads the registry
    assert hook_options("clipped", SimpleNamespace(clip_limit=2.0)) == {"limit": 2.0}
    assert hook_options("clipped", TrainConfig()) == {"limit": 1.0}  # not a field: the default
    with pytest.raises(ValueError, match=r"^limit -1\.0 is invalid: allowed a number > 0$"):
        make_comm_hook("clipped", limit=-1.0)
    with pytest.raises(TypeError):
        make_comm_hook("clipped", ratio=0.5)


def test_the_registry_refuses_clashes(clean_registry: None) -> None:
    _register_clipped()
    with pytest.raises(ValueError, match="'clipped' is already registered"):
        _register_clipped()
    with pytest.raises(ValueError, match="option key 'topk_ratio' is already used by 'topk'"):
        register_hook_family(HookFamily("other", CommHookState, clipped_hook, options=(
            HookOption("topk_ratio", "ratio", float, 0.5, "(0, 1]", lambda r: 0 < r <= 1),)))
    with pytest.raises(ValueError, match="bad_default 0 is invalid: allowed > 0"):
        register_hook_family(HookFamily("bad", CommHookState, clipped_hook, options=(
            HookOption("bad_default", "x", int, 0, "> 0", lambda v: v > 0),)))
    with pytest.raises(ValueError, match="collective 'broadcast' is invalid: allowed allreduce"):
        register_hook_family(HookFamily("bc", CommHookState, clipped_hook, collective="broadcast"))
    with pytest.raises(TypeError, match="must subclass CommHookState"):
        register_hook_family(HookFamily("nostate", object, clipped_hook))  # type: ignore[arg-type]
    assert "other" not in hook_names() and "bad" not in hook_names()
    with pytest.raises(ValueError, match=r"unknown comm hook 'qsgd'; expected one of allreduce"):
        make_comm_hook("qsgd")


@pytest.mark.parametrize(("state_class", "settings", "message"), [
    (TopKState, {"ratio": 0.0}, "ratio 0.0 is invalid: allowed 0 < ratio <= 1"),
    (TopKState, {"ratio": "0.1"}, "ratio '0.1' is invalid: allowed 0 < ratio <= 1"),
    (SignumState, {"beta": 1.0}, "beta 1.0 is invalid: allowed 0 <= beta < 1"),
    (PowerSGDHookState, {"matrix_approximation_rank": 0},
     "matrix_approximation_rank 0 is invalid: allowed an integer >= 1"),
    (PowerSGDHookState, {"matrix_approximation_rank": 2.0},
     "matrix_approximation_rank 2.0 is invalid: allowed an integer >= 1"),
    (PowerSGDHookState, {"start_powerSGD_iter": -1},
     "start_powerSGD_iter -1 is invalid: allowed an integer >= 0"),
    (PowerSGDHookState, {"min_compression_rate": 0}, "min_compression_rate 0 is invalid"),
    (PowerSGDHookState, {"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon"),
    (PowerSGDHookState, {"random_seed": -1}, "random_seed -1 is invalid: allowed an integer"),
])
def test_each_state_rejects_a_bad_setting_in_one_line(
    state_class: type, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        state_class(**settings)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_config_keys_and_checks_come_from_the_registry() -> None:
    # The flat keys users have always typed, with their types and training defaults.
    defaults = {"powersgd_rank": 4, "powersgd_start_iter": 10, "topk_ratio": 0.01,
                "signum_beta": 0.9}
    for key, value in defaults.items():
        assert FIELDS[key].default == value and field_kind(key) is type(value)
    names = list(FIELDS)
    assert names[names.index("comm") + 1: names.index("comm") + 5] == [
        "powersgd_rank", "powersgd_start_iter", "signum_beta", "topk_ratio"]
    cfg = load_config(overrides={"comm": "powersgd", "powersgd_rank": "2",
                                 "powersgd_start_iter": "3"})
    assert hook_options(cfg.comm, cfg) == {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
    assert hook_options("allreduce", cfg) == {}
    with pytest.raises(ConfigError, match=r"^topk_ratio 1\.5 is invalid: allowed 0 < ratio <= 1$"):
        load_config(overrides={"topk_ratio": "1.5"})
    with pytest.raises(ConfigError, match=r"^powersgd_rank 0 is invalid: allowed an integer >= 1"):
        TrainConfig(powersgd_rank=0)


def test_bench_offers_every_builtin_hook() -> None:
    assert set(HOOK_NAMES) - {"allreduce"} <= set(METHODS)
    assert METHODS["ddp"] == (False, "allreduce")
    # from each family's `collective`, also where Pufferfish composes with the hook
    assert sorted(ALLGATHER_METHODS) == ["pufferfish+signum", "pufferfish+topk", "signum", "topk"]
    assert METHODS["pufferfish+fp16"] == (True, "fp16")
    bench = BenchConfig()
    assert bench.powersgd_start_iter == 2 and bench.topk_ratio == 0.01  # the bench's defaults
    bench.signum_beta = 1.0
    with pytest.raises(ValueError, match=r"^signum_beta 1\.0 is invalid: allowed 0 <= beta < 1$"):
        bench.validate()
