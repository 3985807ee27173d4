import itertools
import math

import pytest
import torch
from helpers import set_diag
from torch import nn

import pufferfish as pf
from pufferfish.auto import (
    StableRankTracker,
    SwitchDetector,
    budget_params,
    choose_ranks,
    frobenius_decay,
    frobenius_decay_params,
    layer_matrix,
    layer_stable_rank,
    profile_keep,
    saving_cap,
    stable_rank,
    time_kernels,
    timing,
)
from pufferfish.lowrank import LowRankConv2d, LowRankLinear, LowRankLSTM, factorize
from pufferfish.lowrank.factorize import factorizable_modules

# ---------------------------------------------------------------- stable rank


def test_stable_rank_identity_rank_one_orthogonal() -> None:
    assert stable_rank(torch.eye(7)) == pytest.approx(7, rel=1e-6)
    u, v = torch.randn(9, 1), torch.randn(1, 5)
    assert stable_rank(u @ v) == pytest.approx(1, rel=1e-5)
    q, _ = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))
    assert stable_rank(q) == pytest.approx(12, rel=1e-9)
    assert stable_rank(torch.zeros(3, 4)) == 0.0
    with pytest.raises(ValueError, match="2-D"):
        stable_rank(torch.ones(2, 2, 2))


def test_layer_matrix_shapes_and_averages() -> None:
    conv = nn.Conv2d(3, 8, 3)
    assert layer_matrix(conv).shape == (8, 27)
    lstm = nn.LSTM(4, 6, num_layers=2)
    mats = layer_matrix(lstm)
    assert [tuple(m.shape) for m in mats] == [(24, 4), (24, 6), (24, 6), (24, 6)]
    expected = sum(stable_rank(m) for m in mats) / 4
    assert layer_stable_rank(lstm) == pytest.approx(expected)
    mha = nn.MultiheadAttention(8, 2)
    assert [tuple(m.shape) for m in layer_matrix(mha)] == [(8, 8)] * 4
    low = LowRankLinear.from_dense(nn.Linear(6, 5), 2)
    assert layer_matrix(low).shape == (5, 6)


def test_factorizable_modules_skips_unsupported() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 8, 3), nn.Flatten(),
                          nn.Linear(8, 2))
    assert list(factorizable_modules(model)) == ["1", "3"]


def test_tracker_records_initial_and_history() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    tracker = StableRankTracker(model, keep=["2"])
    assert list(tracker.initial) == ["0"] and tracker.full_ranks == {"0": 8}
    assert tracker.history == {"0": []}
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
    assert tracker.observe(1) == {"0": pytest.approx(8)}
    assert tracker.history["0"] == [(1, pytest.approx(8))]
    with pytest.raises(ValueError, match="matches no module"):
        StableRankTracker(model, keep=["nope"])


# ---------------------------------------------------------------- switch detector


def _feed(detector: SwitchDetector, series: dict[str, list[float]]) -> list[int]:
    steps = len(next(iter(series.values())))
    return [t for t in range(steps)
            if detector.update(t, {name: values[t] for name, values in series.items()})]


def test_switch_fires_on_plateau_not_on_rise() -> None:
    plateau = [10 + 20 * math.exp(-t) for t in range(12)]
    rising = [10 * 1.1 ** t for t in range(12)]
    fired = _feed(SwitchDetector(window=3, threshold=0.05), {"a": plateau})
    assert len(fired) == 1  # exactly one True
    t = fired[0]
    changes = [abs(plateau[i] - plateau[i - 1]) / plateau[i - 1] for i in range(t - 2, t + 1)]
    assert sum(changes) / 3 < 0.05
    before = [abs(plateau[i] - plateau[i - 1]) / plateau[i - 1] for i in range(t - 3, t)]
    assert sum(before) / 3 >= 0.05  # and not one epoch earlier
    assert _feed(SwitchDetector(), {"a": rising}) == []
    # every layer must have settled
    assert _feed(SwitchDetector(), {"a": plateau, "b": rising}) == []


def test_switch_respects_min_and_max() -> None:
    flat = [5.0] * 10
    assert _feed(SwitchDetector(window=3), {"a": flat}) == [3]  # needs window + 1 values
    assert _feed(SwitchDetector(window=3, min_epochs=6), {"a": flat}) == [6]
    rising = [10 * 1.5 ** t for t in range(10)]
    detector = SwitchDetector(max_epochs=4)
    assert _feed(detector, {"a": rising}) == [4]
    assert detector.switched_at == 4
    with pytest.raises(ValueError, match="increase"):
        detector.update(4, {"a": 1.0})


def test_switch_time_does_not_depend_on_how_often_ranks_are_observed() -> None:
    # The same decay observed once per epoch and four times per epoch, window 2 epochs: the test
    # is a change per epoch, so both settle at about the same time.
    def plateau(t: float) -> float:
        return 10 + 20 * math.exp(-t)

    def fire_time(per_epoch: int) -> float:
        detector = SwitchDetector(window=2.0, threshold=0.05)
        times = [i / per_epoch for i in range(12 * per_epoch)]
        fired = [t for t in times if detector.update(t, {"a": plateau(t)})]
        assert len(fired) == 1 and detector.reason == "settled"
        return fired[0]

    coarse, fine = fire_time(1), fire_time(4)
    assert abs(coarse - fine) <= 1.0
    # the rule by hand at the fine firing point: total relative change over the last 2 epochs / 2
    pts = [plateau(fine - k / 4) for k in range(8, -1, -1)]
    assert sum(abs(b - a) / a for a, b in itertools.pairwise(pts)) / 2 < 0.05


def test_switch_sees_a_rank_that_rises_and_falls_back() -> None:
    # Same value at both ends of every window, but moving 20% between observations: not settled.
    zigzag = [10.0, 12.0] * 20
    detector = SwitchDetector(window=1.0, threshold=0.05)
    assert not any(detector.update(i / 4, {"a": v}) for i, v in enumerate(zigzag))
    assert detector.smoothed_change("a") > 0.05


def test_switch_window_must_be_positive() -> None:
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="window"):
            SwitchDetector(window=bad)


# ---------------------------------------------------------------- choose_ranks


def test_cuttlefish_rule_and_saving_cap() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    assert saving_cap(model[0]) == 31  # r·128 + 64 < 64·64 + 64
    set_diag(model[0], [1.0] * 32)  # stable rank at init 32 -> scale 64/32 = 2
    tracker = StableRankTracker(model)
    assert tracker.initial["0"] == pytest.approx(32)
    set_diag(model[0], [1.0] * 10)  # stable rank now 10 -> rank 20
    assert choose_ranks(tracker) == {"0": 20}
    set_diag(model[0], [1.0] * 30)  # 60 would not save parameters -> capped at 31
    ranks = choose_ranks(tracker)
    assert ranks == {"0": 31}
    report = factorize(model, overrides=ranks)
    assert report.ranks == {"0": 31}


def test_max_ratio_caps_the_cuttlefish_rank() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    set_diag(model[0], [1.0] * 32)
    tracker = StableRankTracker(model)
    set_diag(model[0], [1.0] * 10)  # the rule says 20
    assert choose_ranks(tracker, max_ratio=0.25) == {"0": 16}  # budget: round(64/4)
    assert choose_ranks(tracker, max_ratio=0.5) == {"0": 20}  # under the budget: the rule's rank
    with pytest.raises(ValueError, match="max_ratio 0"):
        choose_ranks(tracker, max_ratio=0)


def test_unsettled_layers_get_the_budget_rank() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    set_diag(model[0], [1.0] * 32)
    tracker = StableRankTracker(model)
    set_diag(model[0], [1.0] * 4)  # the rule says 8
    assert choose_ranks(tracker, max_ratio=0.25) == {"0": 8}
    assert choose_ranks(tracker, max_ratio=0.25, unsettled=["0"]) == {"0": 16}  # round(64/4)
    assert choose_ranks(tracker, unsettled=["0"]) == {"0": 8}  # no budget: the rule's rank


def test_choose_ranks_from_model_needs_initial() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    set_diag(model[0], [1.0] * 8)
    with pytest.raises(ValueError, match="initialization"):
        choose_ranks(model)
    ranks = choose_ranks(model, initial={"0": 64.0}, keep=["1"])
    assert ranks == {"0": 8}


def test_energy_rule_on_known_spectrum() -> None:
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    set_diag(model[0], [4.0, 3.0, 2.0, 1.0])  # σ² = 16, 9, 4, 1 of 30
    for energy, rank in [(0.5, 1), (0.8, 2), (0.9, 3), (0.96, 3), (0.97, 4), (1.0, 4)]:
        assert choose_ranks(model, rule="energy", energy=energy) == {"0": rank}


# ---------------------------------------------------------------- profile_keep


@pytest.fixture
def launch_count_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decisions from a deterministic cost: one ms per parameterized leaf module (kernel launch).

    The real timer still runs (so the timing code is exercised), but what it measured on this
    shared machine must not decide a test: under load a 4x4 layer measured factorized 4x faster.
    """
    from pufferfish.auto import timing

    real = timing.time_steps

    def timer(layers: list[nn.Module], *args: object) -> list[float]:
        real(layers, *args)
        return [float(sum(1 for m in layer.modules()
                          if not list(m.children()) and any(True for _ in m.parameters())))
                for layer in layers]

    monkeypatch.setattr(timing, "time_steps", timer)


@pytest.mark.usefixtures("launch_count_timer")
def test_profile_keep_keeps_tiny_layer() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4), nn.Linear(4, 4))
    keep, info = profile_keep(model, torch.randn(8, 512), {"0": 64, "2": 4, "3": 1}, repeats=3)
    assert "3" in keep and "0" not in keep
    assert info["3"]["decision"] == "keep" and "kept" in info["3"]["reason"]
    assert info["3"]["input_shape"] == [[8, 4]]
    assert info["3"]["speedup"] is not None and info["3"]["param_saving_share"] < 0.01
    assert info["0"]["decision"] == "factorize" and info["0"]["param_saving_share"] > 0.5
    assert info["0"]["dense_ms"] > 0 and info["0"]["lowrank_ms"] > 0
    assert info["2"]["decision"] == "keep" and "no parameter saving" in info["2"]["reason"]
    assert isinstance(model[0], nn.Linear)  # the model is untouched
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.usefixtures("launch_count_timer")
def test_profile_keep_gives_up_slow_layers_to_fit_a_parameter_budget() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4), nn.Linear(4, 4))
    ranks = {"0": 64, "3": 1}
    total = sum(p.numel() for p in model.parameters())
    saving0 = 512 * 513 - (64 * (512 + 512) + 512)
    saving3 = 20 - (4 + 4 + 4)
    # Room for the tiny layer kept dense: it stays kept (it is slower factorized).
    keep, info = profile_keep(model, torch.randn(8, 512), ranks, repeats=3,
                              max_params=total - saving0)
    assert keep == ["3"] and info["3"]["decision"] == "keep"
    # No room: factorized after all, with the reason.
    keep, info = profile_keep(model, torch.randn(8, 512), ranks, repeats=3,
                              max_params=total - saving0 - saving3)
    assert keep == [] and info["3"]["decision"] == "factorize"
    assert "budget" in info["3"]["reason"] and info["3"]["speedup"] < 1.0
    assert budget_params(model, 0.125, keep=["2"]) == total - saving0 - saving3  # ranks 64, 1


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(24, 24, num_layers=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_lstm_kernels_are_timed_and_the_recipe_runs_the_faster() -> None:
    x = torch.randn(12, 4, 24)
    model = _Recurrent()
    _, info = profile_keep(model, x, {"rnn": 6}, repeats=3)
    m = info["rnn"]  # judged by the faster of the two kernels
    assert set(m["kernel_ms"]) == {"fused", "loop"} and m["lowrank_ms"] == min(m["kernel_ms"].values())
    assert time_kernels(model, x) == {}  # nothing factorized yet
    recipe = pf.Recipe(warmup_epochs=0, rank_ratio=0.25, example_input=x)
    recipe.switch(0, model, None)
    assert isinstance(model.rnn, LowRankLSTM)
    chosen = recipe.decisions["kernels"]["rnn"]
    assert chosen["fused_ms"] > 0 and chosen["loop_ms"] > 0
    assert chosen["kernel"] == ("fused" if chosen["fused_ms"] <= chosen["loop_ms"] else "loop")
    assert model.rnn.fused == (chosen["kernel"] == "fused")
    assert f"-> {chosen['kernel']}" in recipe.describe_decisions()
    # Either kernel, the MAC count is the factorized arithmetic's.
    macs = pf.count_macs(model, x)
    model.rnn.fused = not model.rnn.fused
    assert pf.count_macs(model, x) == macs


def test_profile_keep_captures_conv_input_shape() -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1))
    _, info = profile_keep(model, torch.randn(2, 3, 8, 8), {"*": 0.25}, repeats=1, warmup=0)
    assert info["3"]["input_shape"] == [[2, 16, 4, 4]]
    assert info["3"]["rank"] == 8


# ---------------------------------------------------------------- frobenius decay


def test_frobenius_decay_value_and_gradient() -> None:
    model = nn.Sequential(LowRankLinear(7, 5, 3), nn.ReLU(), LowRankConv2d(2, 4, (3, 3), 2))
    pairs = [(model[0].u.weight, model[0].v.weight),
             (model[2].u.weight.flatten(1), model[2].v.weight.flatten(1))]
    params = [model[0].u.weight, model[0].v.weight, model[2].u.weight, model[2].v.weight]

    got = frobenius_decay(model, coeff=2.0)  # coeff/2 = 1: plain Σ‖UV‖²
    direct = sum(((u @ v) ** 2).sum() for u, v in pairs)
    assert got.item() == pytest.approx(direct.item(), rel=1e-5)
    grads = torch.autograd.grad(got, params)
    expected = torch.autograd.grad(direct, params)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    u, v = pairs[0]
    torch.testing.assert_close(grads[0], 2 * (u @ v) @ v.T)
    torch.testing.assert_close(grads[1], 2 * u.T @ (u @ v))
    assert frobenius_decay(model, coeff=0.1).item() == pytest.approx(0.05 * direct.item(), rel=1e-5)
    assert frobenius_decay(nn.Linear(3, 3), coeff=1.0).item() == 0.0


def test_frobenius_decay_params_are_the_factors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), LowRankLinear(7, 5, 3),
                          LowRankConv2d(2, 4, (3, 3), 2, extra_bn=True))
    got = {id(p) for p in frobenius_decay_params(model)}
    want = {id(model[1].u.weight), id(model[1].v.weight), id(model[2].u.weight),
            id(model[2].v.weight)}
    assert got == want
    # Channels-last (training's default): the conv factors flattened to matrices are copies.
    model.to(memory_format=torch.channels_last)
    assert not model[2].v.weight.is_contiguous()  # the 3x3 factor (a 1x1 is both layouts)
    assert {id(p) for p in frobenius_decay_params(model)} == want


def test_frobenius_decay_on_factorized_lstm_and_attention() -> None:
    model = nn.ModuleDict({"rnn": nn.LSTM(4, 6), "attn": nn.MultiheadAttention(8, 2),
                           "fc": nn.Linear(8, 8)})
    factorize(model, rank=2)
    pairs = [pair for m in model.values() for pair in m.factor_pairs()]
    assert len(pairs) == 2 + 4 + 1
    direct = sum(((u @ v) ** 2).sum() for u, v in pairs)
    assert frobenius_decay(model, 1.0).item() == pytest.approx(direct.item() / 2, rel=1e-5)
    factors = {id(p) for p in frobenius_decay_params(model)}
    names = {n for n, p in model.named_parameters() if id(p) in factors}
    assert len(factors) == 14 and not any("bias" in n for n in names)


def test_layers_are_timed_under_the_run_s_autocast_and_factorized_outside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pufferfish.switch as switch

    seen: list[tuple[str, object]] = []

    def recorder(what: str, result: object):  # the timings, replaced: no bf16 kernel runs
        def timed(*args: object, amp_dtype: object = None, **kwargs: object) -> object:
            seen.append((what, amp_dtype))
            return result
        return timed

    monkeypatch.setattr(switch, "profile_keep", recorder("keep", ([], {})))
    monkeypatch.setattr(switch, "time_kernels", recorder("kernels", {}))
    for amp in (torch.bfloat16, None):
        seen.clear()
        model = _Recurrent()
        recipe = pf.Recipe(warmup_epochs=0, keep="auto", example_input=torch.randn(3, 2, 24),
                           amp_dtype=amp)
        recipe.switch(0, model, None)
        assert seen == [("keep", amp), ("kernels", amp)]
        # the SVD's factors stay fp32, whatever the timing runs under
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"amp_dtype torch\.float32 is invalid: allowed "
                                         r"torch\.float16, torch\.bfloat16 or None"):
        pf.Recipe(amp_dtype=torch.float32)


class _Scale(nn.Module):
    """An elementwise layer (no kernel autocast recasts) that records where it ran."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.w, self.seen = nn.Parameter(torch.ones(4)), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(f"forward autocast={torch.is_autocast_enabled('cpu')}")
        y = x * self.w
        y.register_hook(lambda g: self.seen.append(
            f"backward autocast={torch.is_autocast_enabled('cpu')}"))
        return y


def test_each_timed_forward_enters_the_autocast_and_no_backward_runs_under_it() -> None:
    seen: list[str] = []
    layer = _Scale(seen)
    captured = timing.capture_inputs(nn.Sequential(layer), torch.randn(2, 4), [layer],
                                     amp_dtype=torch.bfloat16)
    assert seen == ["forward autocast=True"]  # the capture's forward, as the run's
    seen.clear()
    timing.time_steps([layer], *captured[id(layer)], repeats=1, warmup=1,
                      amp_dtype=torch.bfloat16)
    assert set(seen) == {"forward autocast=True", "backward autocast=False"}
    seen.clear()
    timing.time_steps([layer], *captured[id(layer)], repeats=1, warmup=0)
    assert "forward autocast=True" not in seen


def test_the_trainers_mixed_precision_is_the_timing_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainingArguments

    from pufferfish.integrations import hf, lightning

    assert hf.amp_dtype(TrainingArguments("unused", bf16=True, use_cpu=True)) == torch.bfloat16
    assert hf.amp_dtype(TrainingArguments("unused", use_cpu=True)) is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # `accelerate launch`'s
    assert hf.amp_dtype(TrainingArguments("unused", use_cpu=True)) == torch.bfloat16
    assert lightning.amp_dtype("16-mixed") == torch.float16
    assert lightning.amp_dtype("bf16-mixed") == torch.bfloat16
    assert lightning.amp_dtype("bf16-true") is None and lightning.amp_dtype("32-true") is None
    given = hf.PufferfishCallback(amp_dtype=torch.float16)  # the recipe's own wins
    given.switcher.follow_amp(torch.bfloat16)
    assert given.recipe.switch_owner.plan.amp_dtype == torch.float16
    followed = hf.PufferfishCallback()
    followed.switcher.follow_amp(torch.bfloat16)
    assert followed.recipe.switch_owner.plan.amp_dtype == torch.bfloat16


def test_train_s_amp_is_the_timing_s() -> None:
    from pufferfish.config import TrainConfig
    from pufferfish.method import PufferfishMethod

    for amp, want in ((True, torch.bfloat16), (False, None)):  # bf16 autocast on the CPU
        cfg = TrainConfig(amp=amp, epochs=2, preset="none")
        method = PufferfishMethod(cfg)
        method.setup(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), cfg)
        assert method.switch.plan.amp_dtype == want
