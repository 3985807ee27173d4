"""Tests of the DDP compression hooks in ``pufferfish.distributed.hooks``.

The distributed checks run in ONE real 2-process gloo group (spawned once per module,
since each process start costs seconds of torch import); the workers only collect
numbers and the assertions live in the individual tests below.
"""

import copy
import io
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pufferfish.distributed.env import cleanup, exit_process
from pufferfish.distributed.hooks import (
    HOOK_NAMES,
    CommHookState,
    CommStats,
    PowerSGDHookState,
    SignumState,
    TopKState,
    make_comm_hook,
    pack_bits,
    powersgd_payload_numel,
    register_comm_hook,
    ring_bytes,
    topk_count,
    unpack_bits,
)

WORLD = 2
STEPS = 4
PSGD_START = 2
OPTIONS: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "fp16": {},
    "powersgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": PSGD_START},
    "signum": {"beta": 0.9},
    "topk": {"ratio": 0.1},
}
LR = {"allreduce": 0.1, "fp16": 0.1, "powersgd": 0.1, "signum": 0.01, "topk": 0.1}


# --------------------------------------------------------------------------- worker side


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # 32x16 and 4x32 weights are worth compressing at rank 1; biases are not.
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _replica_gap(model: nn.Module) -> float:
    """Max |param difference| between the ranks (0.0 when the replicas are identical)."""
    flat = _flat_params(model)
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def _recording(hook, log: list):
    """Wrap a hook to record the gradient shapes of every bucket it sees."""

    def wrapped(state, bucket):
        log.append([tuple(g.shape) for g in bucket.gradients()])
        return hook(state, bucket)

    return wrapped


def _train_run(name: str, rank: int) -> dict[str, Any]:
    """A few SGD steps with small buckets; per-step stats and bucket shapes."""
    model = _mlp()
    init = _flat_params(model)
    # ~1 KB buckets. DDP only honours the cap for its initial bucketing, which it only
    # does with find_unused_parameters; this gives two buckets per step.
    ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    state, hook = make_comm_hook(name, **OPTIONS[name])
    buckets: list = []
    ddp.register_comm_hook(state, _recording(hook, buckets))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR[name])
    steps = []
    for step in range(STEPS):
        state.stats.reset()
        buckets.clear()
        opt.zero_grad()
        _loss(ddp, step, rank).backward()
        record = {"stats": state.stats.snapshot(), "buckets": list(buckets)}
        if isinstance(state, PowerSGDHookState):
            record["torch_numel_after"] = state.powersgd.total_numel_after_compression
        steps.append(record)
        opt.step()
    return {
        "steps": steps,
        "replica_gap": _replica_gap(model),
        "moved": (_flat_params(model) - init).abs().max().item(),
    }


def _grads_vs_plain(name: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    """Gradients of a hooked DDP vs plain DDP (no hook), two backward passes."""
    base = _mlp()
    plain = DDP(copy.deepcopy(base))
    hooked = DDP(copy.deepcopy(base))
    state = register_comm_hook(hooked, name, **options)
    diffs, scales, stats = [], [], []
    for step in range(2):
        for m in (plain, hooked):
            m.zero_grad()
        state.stats.reset()
        _loss(plain, step, rank).backward()
        _loss(hooked, step, rank).backward()
        g_plain = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        g_hooked = torch.cat([p.grad.reshape(-1) for p in hooked.parameters()])
        diffs.append((g_plain - g_hooked).abs().max().item())
        scales.append(g_plain.abs().max().item())
        stats.append(state.stats.snapshot())
    numel = sum(p.numel() for p in base.parameters())
    return {"diffs": diffs, "scales": scales, "stats": stats, "numel": numel}


class _Probe(nn.Module):
    """``loss = sum(w * x)``: the gradient of ``w`` is exactly ``x``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _signum_vote(rank: int) -> dict[str, Any]:
    # beta = 0: momentum == gradient. Magnitudes differ per rank and must not matter.
    if rank == 0:
        x = torch.tensor([3.0, 3.0, -3.0, -3.0] * 5 + [0.0, 0.0])
    else:
        x = torch.tensor([0.5, -0.5, 0.5, -0.5] * 5 + [-1.0, 0.0])
    ddp = DDP(_Probe(x.numel()))
    state = register_comm_hook(ddp, "signum", beta=0.0)
    ddp(x).backward()
    vote = ddp.module.w.grad.clone()
    stats = state.stats.snapshot()

    # beta = 0.5: after g1 = 4, g2 = -1 the momentum is 0.5 > 0 although sign(g2) < 0.
    ddp_m = DDP(_Probe(1))
    state_m = register_comm_hook(ddp_m, "signum", beta=0.5)
    for g in (4.0, -1.0):
        ddp_m.zero_grad()
        ddp_m(torch.tensor([g])).backward()
    return {
        "vote": vote,
        "stats": stats,
        "numel": x.numel(),
        "momentum_vote": ddp_m.module.w.grad.clone(),
        "momentum_buffer": state_m.momentum[0].clone(),
    }


def _elsewhere(state: dict[str, Any]) -> dict[str, Any]:
    """The memory's floating tensors in float64: memory not where the gradients are, as a
    checkpoint's CPU tensors are for a run resumed on a GPU (exactly representable here)."""
    return {k: {i: t.double() if t.is_floating_point() else t for i, t in v.items()}
            if isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values())
            else v for k, v in state.items()}


def _one_layer() -> nn.Module:
    """One weight: one bucket whose layout on a fresh DDP's first step is the saved one, so
    resumed memory goes straight into torch's PowerSGD (no re-assembly on a layout change)."""
    torch.manual_seed(0)
    return nn.Linear(16, 4, bias=False)


def _resume(name: str, rank: int, elsewhere: bool = False) -> dict[str, Any]:
    """Checkpoint the hook state mid-run; a fresh model/DDP/state must continue identically
    (``elsewhere``: one layer, the loaded memory in another dtype than the gradients)."""
    make = _one_layer if elsewhere else _mlp
    model = make()
    ddp = DDP(model)
    state = register_comm_hook(ddp, name, **OPTIONS[name])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR[name])

    def step(m: nn.Module, o: torch.optim.Optimizer, i: int) -> None:
        o.zero_grad()
        _loss(m, i, rank).backward()
        o.step()

    for i in range(3):
        step(ddp, opt, i)
    weights = copy.deepcopy(model.state_dict())
    blob = io.BytesIO()
    torch.save(state.state_dict(), blob)  # must survive a weights_only round trip
    for i in range(3, 6):
        step(ddp, opt, i)

    model2 = make()
    model2.load_state_dict(weights)
    ddp2 = DDP(model2)
    state2, hook2 = make_comm_hook(name, **OPTIONS[name])
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)
    state2.load_state_dict(_elsewhere(loaded) if elsewhere else loaded)
    ddp2.register_comm_hook(state2, hook2)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=LR[name])
    for i in range(3, 6):
        step(ddp2, opt2, i)
    return {"gap": (_flat_params(model) - _flat_params(model2)).abs().max().item()}


def _nonfinite_step(name: str, rank: int) -> dict[str, Any]:
    """Compressing steps, then one whose gradient on rank 0 is inf (an fp16 overflow; the
    optimizer skips it, as GradScaler does), then more: the hook's memory must not keep it."""
    model = _mlp()
    ddp = DDP(model)
    state = register_comm_hook(ddp, name, **OPTIONS[name])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR[name])
    finite = []
    for step in range(PSGD_START + 4):
        opt.zero_grad()
        loss = _loss(ddp, step, rank)
        if step == PSGD_START + 1 and rank == 0:
            loss = loss * float("inf")
        loss.backward()
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        if finite[-1]:
            opt.step()
    memory = [t for t in state.state_dict().values() if isinstance(t, dict)]
    memory_finite = all(bool(torch.isfinite(v).all()) for d in memory for v in d.values()
                        if isinstance(v, torch.Tensor) and v.is_floating_point())
    return {"finite": finite, "replica_gap": _replica_gap(model), "memory_finite": memory_finite}


class _Tempered(nn.Module):
    """The MLP's output times a learned 0-d temperature (as CLIP's logit scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.scale


def _scalar_parameter(name: str, rank: int) -> dict[str, Any]:
    """Backward passes past PowerSGD's start on a model with a 0-d parameter (no optimizer step,
    so both see the same weights): the 0-d gradient beside plain DDP's, and the replicas."""
    plain, hooked = DDP(_Tempered()), DDP(_Tempered())
    register_comm_hook(hooked, name, **OPTIONS[name])
    for step in range(STEPS):
        for ddp in (plain, hooked):
            ddp.zero_grad()
            _loss(ddp, step, rank).backward()
    grads = [m.module.scale.grad.reshape(1) for m in (plain, hooked)]
    gathered = [torch.empty(1) for _ in range(WORLD)]
    dist.all_gather(gathered, grads[1])
    return {"plain": grads[0].item(), "hooked": grads[1].item(),
            "ranks_agree": all(g.item() == gathered[0].item() for g in gathered)}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    finished = False
    try:
        results: dict[str, Any] = {
            "train": {name: _train_run(name, rank) for name in HOOK_NAMES},
            "grads": {
                "allreduce": _grads_vs_plain("allreduce", {}, rank),
                "fp16": _grads_vs_plain("fp16", {}, rank),
                "topk_full": _grads_vs_plain("topk", {"ratio": 1.0}, rank),
            },
            "signum": _signum_vote(rank),
            "resume": {name: _resume(name, rank) for name in ("powersgd", "signum", "topk")},
            "resume_elsewhere": {name: _resume(name, rank, elsewhere=True)
                                 for name in ("powersgd", "signum", "topk")},
            "nonfinite": {name: _nonfinite_step(name, rank)
                          for name in ("powersgd", "topk", "signum")},
            "scalar": {name: _scalar_parameter(name, rank) for name in ("allreduce", "powersgd")},
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        finished = True
    finally:
        cleanup(drain=finished)  # a bare destroy_process_group let rank 1 abort at exit under load
    exit_process(0)  # no interpreter shutdown after a group (pufferfish.distributed.env)


# --------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("comm_hooks")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _expected_bytes(name: str, step: int, buckets: list[list[tuple[int, ...]]]) -> int:
    if name == "allreduce":
        return sum(4 * _numel(b) for b in buckets)
    if name == "fp16":
        return sum(2 * _numel(b) for b in buckets)
    if name == "signum":
        return sum(math.ceil(_numel(b) / 8) for b in buckets)
    if name == "topk":
        return sum(topk_count(_numel(b), OPTIONS["topk"]["ratio"]) * (4 + 4) for b in buckets)
    if step < PSGD_START:
        return sum(4 * _numel(b) for b in buckets)
    return sum(4 * sum(powersgd_payload_numel(b, 1, 2)) for b in buckets)


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_replicas_stay_identical(runs, name):
    for r in runs:
        assert r["train"][name]["replica_gap"] == 0.0
        assert r["train"][name]["moved"] > 0.0  # the steps actually changed the model


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_byte_counters_match_analytic_sizes(runs, name):
    n_params = sum(p.numel() for p in _mlp().parameters())
    for r in runs:
        for step, rec in enumerate(r["train"][name]["steps"]):
            buckets, stats = rec["buckets"], rec["stats"]
            assert _numel([s for b in buckets for s in b]) == n_params
            assert stats["buckets"] == len(buckets)
            assert stats["dense_bytes"] == 4 * n_params
            assert stats["bytes_sent"] == _expected_bytes(name, step, buckets)
            kind = "allgather" if name in ("signum", "topk") else "allreduce"
            assert stats["ring_bytes"] == pytest.approx(
                ring_bytes(kind, 1, WORLD) * stats["bytes_sent"]
            )
            calls_per_bucket = 3 if name == "powersgd" and step >= PSGD_START else 1
            assert stats["comm_calls"] == calls_per_bucket * len(buckets)
            assert stats["hook_time"] > 0.0
            if name in ("fp16", "signum", "topk"):
                assert 0.0 < stats["compress_time"] <= stats["hook_time"]
    # Several buckets per step, so per-bucket rounding (ceil, k) is really exercised.
    assert len(runs[0]["train"][name]["steps"][-1]["buckets"]) > 1


def test_powersgd_bytes_agree_with_torch_counters(runs):
    """Our analytic count equals torch's own ``total_numel_after_compression`` x 4."""
    steps = runs[0]["train"]["powersgd"]["steps"]
    for prev, cur in zip(steps[PSGD_START:], steps[PSGD_START + 1 :]):
        added = cur["torch_numel_after"] - prev["torch_numel_after"]
        assert cur["stats"]["bytes_sent"] == 4 * added
        assert cur["stats"]["bytes_sent"] < cur["stats"]["dense_bytes"] / 4
    first = steps[PSGD_START]
    assert first["stats"]["bytes_sent"] == 4 * first["torch_numel_after"]
    assert first["stats"]["compress_time"] > 0.0


def test_allreduce_matches_plain_ddp(runs):
    for r in runs:
        g = r["grads"]["allreduce"]
        assert g["diffs"] == [0.0, 0.0]
        assert [s["bytes_sent"] for s in g["stats"]] == [4 * g["numel"]] * 2
        assert [s["compress_time"] for s in g["stats"]] == [0.0, 0.0]


def test_fp16_matches_plain_ddp_within_fp16_tolerance(runs):
    for r in runs:
        g = r["grads"]["fp16"]
        for diff, scale in zip(g["diffs"], g["scales"]):
            assert diff <= 2e-3 * scale + 1e-6
        assert [s["bytes_sent"] for s in g["stats"]] == [2 * g["numel"]] * 2


def test_topk_full_ratio_is_exactly_the_average(runs):
    for r in runs:
        g = r["grads"]["topk_full"]
        assert g["diffs"] == [0.0, 0.0]
        assert [s["bytes_sent"] for s in g["stats"]] == [8 * g["numel"]] * 2


def test_signum_majority_vote(runs):
    expected = torch.tensor([1.0, 0.0, 0.0, -1.0] * 5 + [0.0, 1.0])  # ties -> 0, sign(0) = +1
    for r in runs:
        s = r["signum"]
        assert torch.equal(s["vote"], expected)
        assert s["stats"]["bytes_sent"] == math.ceil(s["numel"] / 8) == 3
        assert s["stats"]["comm_calls"] == 1
        assert torch.equal(s["momentum_buffer"], torch.tensor([0.5]))
        assert torch.equal(s["momentum_vote"], torch.tensor([1.0]))


@pytest.mark.parametrize("name", ["powersgd", "signum", "topk"])
def test_state_dict_resume_is_exact(runs, name):
    for r in runs:
        assert r["resume"][name]["gap"] == 0.0
        # memory loaded on another device / in another dtype is moved to the gradients' own
        assert r["resume_elsewhere"][name]["gap"] == 0.0


@pytest.mark.parametrize("name", ["powersgd", "topk"])
def test_a_skipped_nonfinite_step_does_not_poison_the_memory(runs, name):
    # The inf step comes back non-finite on both ranks (so both skip it); the steps after it are
    # finite again (without forget_if_nonfinite, PowerSGD's error and Q stayed NaN for good).
    bad = PSGD_START + 1
    for rank in runs:
        finite = rank["nonfinite"][name]["finite"]
        assert finite[:bad] == [True] * bad and finite[bad] is False, finite
        assert finite[bad + 1:] == [True] * (len(finite) - bad - 1), finite
        assert rank["nonfinite"][name]["replica_gap"] == 0.0
        assert rank["nonfinite"][name]["memory_finite"]


@pytest.mark.parametrize("name", ["allreduce", "powersgd"])
def test_a_scalar_parameter_is_all_reduced_plainly(runs, name):
    """A 0-d parameter (a learned temperature) crashed torch's PowerSGD hook once it compressed;
    now it joins the plain all-reduce: the same gradient as plain DDP's, on every rank."""
    for r in runs:
        got = r["scalar"][name]
        assert got["ranks_agree"]
        assert got["hooked"] == pytest.approx(got["plain"], rel=1e-5, abs=1e-7)


def test_signum_momentum_forgets_a_nonfinite_gradient(runs):
    # Signum's votes are finite whatever the momentum holds, so the step is not seen as
    # non-finite; a NaN kept in the momentum would vote -1 on every later step.
    for rank in runs:
        assert rank["nonfinite"]["signum"]["memory_finite"]
        assert rank["nonfinite"]["signum"]["replica_gap"] == 0.0


# --------------------------------------------------------------------------- no process group


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 101])
def test_pack_bits_round_trip_matches_numpy(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(n / 8)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy()))
    assert torch.equal(unpack_bits(packed, n), bits)


def test_unpack_bits_batched_and_errors():
    rows = torch.rand(3, 13, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = torch.stack([pack_bits(row) for row in rows])
    assert torch.equal(unpack_bits(packed, 13), rows)
    assert torch.equal(pack_bits(rows), pack_bits(rows.reshape(-1)))  # flattens
    with pytest.raises(ValueError, match="cannot unpack"):
        unpack_bits(packed, 17)
    with pytest.raises(TypeError):
        unpack_bits(packed.int(), 13)


def test_make_comm_hook_names_and_errors():
    assert set(HOOK_NAMES) == {"allreduce", "fp16", "powersgd", "signum", "topk"}
    for name in HOOK_NAMES:
        state, hook = make_comm_hook(name, **OPTIONS[name])
        assert isinstance(state, CommHookState)
        assert callable(hook)
    with pytest.raises(ValueError, match=r"'qsgd'.*allreduce, fp16, powersgd, signum, topk"):
        make_comm_hook("qsgd")
    with pytest.raises(TypeError):
        make_comm_hook("allreduce", ratio=0.5)
    with pytest.raises(ValueError, match="beta"):
        make_comm_hook("signum", beta=1.0)
    with pytest.raises(ValueError, match="ratio"):
        make_comm_hook("topk", ratio=0.0)


def test_fresh_keeps_options_and_drops_memory():
    state = TopKState(ratio=0.05)
    state.residual[0] = torch.ones(3)
    state.stats.add_bucket(12)
    new = state.fresh()
    assert type(new) is TopKState and new.ratio == 0.05
    assert new.residual == {} and new.stats.buckets == 0
    psgd = PowerSGDHookState(matrix_approximation_rank=4, start_powerSGD_iter=7)
    psgd.powersgd.iter = 9
    fresh = psgd.fresh()
    assert fresh.powersgd.matrix_approximation_rank == 4
    assert fresh.powersgd.start_powerSGD_iter == 7 and fresh.powersgd.iter == 0


def test_state_dict_round_trip_offline():
    sig = SignumState(beta=0.5)
    sig.momentum.update({0: torch.arange(4.0), 3: torch.ones(2)})
    sig2 = SignumState()
    sig2.load_state_dict(sig.state_dict())
    assert sig2.momentum.keys() == {0, 3} and torch.equal(sig2.momentum[0], torch.arange(4.0))
    sig.momentum[0].zero_()  # no aliasing between the state and its checkpoint
    assert torch.equal(sig2.momentum[0], torch.arange(4.0))

    psgd = PowerSGDHookState(start_powerSGD_iter=2)
    psgd.powersgd.rng.randint(10)
    psgd.powersgd.error_dict[1] = torch.ones(3)
    sd = psgd.state_dict()
    expected_draw = psgd.powersgd.rng.randint(1_000_000)
    psgd2 = PowerSGDHookState(start_powerSGD_iter=2)
    psgd2.load_state_dict(sd)
    assert psgd2.powersgd.rng.randint(1_000_000) == expected_draw
    assert torch.equal(psgd2.powersgd.error_dict[1], torch.ones(3))
    assert all(isinstance(v, torch.Tensor | int | float | dict) for v in sd.values())


def test_powersgd_payload_rule():
    # 64x64 at rank 2: 256 * 2 < 4096 -> compressed; 1-D bias: never; 3x3 at rank 1: 6*2 > 9.
    assert powersgd_payload_numel([(64, 64), (64,), (3, 3)], 2, 2) == (64 + 9, 128, 128)
    # conv kernel viewed as out x (in * kh * kw)
    assert powersgd_payload_numel([(16, 8, 3, 3)], 1, 2) == (0, 16, 72)


def test_comm_stats_accumulate_reset_snapshot():
    stats = CommStats()
    stats.add_bucket(400)
    stats.add_collective("allreduce", 400, 4)
    stats.add_collective("allgather", 10, 4)
    stats.add_compress_time(0.5)
    snap = stats.snapshot()
    assert snap["bytes_sent"] == 410 and snap["comm_calls"] == 2 and snap["buckets"] == 1
    assert snap["ring_bytes"] == pytest.approx(2 * 3 / 4 * 400 + 3 * 10)
    stats.reset()
    assert all(v == 0 for v in stats.snapshot().values())
    with pytest.raises(ValueError):
        ring_bytes("broadcast", 1, 2)


def test_bucket_memory_follows_parameters_across_rebucketing():
    from pufferfish.distributed.hooks import _BucketMemory

    mem = _BucketMemory()
    # Step 0: bucket 0 = [A(2), B(3)], bucket 1 = [C(1)].
    mem.get(0, ((0, 2), (1, 3)), torch.zeros(5)).copy_(torch.tensor([1.0, 2, 3, 4, 5]))
    mem.get(1, ((2, 1),), torch.zeros(1)).fill_(6.0)
    mem.end_step()
    # Re-bucketed: bucket 0 = [C, B], bucket 1 = [A, D(new)].
    b0 = mem.get(0, ((2, 1), (1, 3)), torch.zeros(4))
    b1 = mem.get(1, ((0, 2), (3, 2)), torch.zeros(4))  # needs A from the replaced bucket 0
    assert b0.tolist() == [6.0, 3.0, 4.0, 5.0]
    assert b1.tolist() == [1.0, 2.0, 0.0, 0.0]
    _, complete = mem.get_with_status(1, ((0, 2), (3, 2)), torch.zeros(4))
    assert complete  # same layout: the buffer is reused as is
    mem.end_step()
    assert mem._retired == []
    # Round trip through a checkpoint keeps the layouts.
    mem2 = _BucketMemory()
    mem2.load_state_dict(mem.state_dict())
    assert mem2.layouts == mem.layouts
    assert torch.equal(mem2.buffers[0], b0)
