"""pufferfish.factorize / merge on models nobody designed for."""

import gzip
from pathlib import Path

import pytest
import torch
from torch import nn

import pufferfish as pf
import pufferfish.models
from pufferfish.lowrank import LowRankConv2d, LowRankLinear


class Custom(nn.Module):
    """A third-party layer type factorize knows nothing about."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def test_nested_sequentials_and_report() -> None:
    model = small_cnn()
    x = torch.randn(2, 1, 12, 12)
    report = pf.factorize(model, rank_ratio=0.25, example_input=x)
    by_name = {d.name: d for d in report.layers}
    assert by_name["3.0"].factorized and by_name["3.0"].rank == 8  # min(32, 16*9) / 4
    assert by_name["3.3.0"].factorized
    assert isinstance(model.get_submodule("3.3.0"), LowRankConv2d)
    assert isinstance(model.get_submodule("6"), LowRankLinear)
    assert by_name["0"].rank == 2 and by_name["0"].full_rank == 9  # 1 input channel x 3x3
    assert report.params_before == sum(p.numel() for p in small_cnn().parameters())
    assert report.params_after == sum(p.numel() for p in model.parameters()) < report.params_before
    assert report.macs_after < report.macs_before
    text = str(report)
    assert "3.3.0" in text and "parameters:" in text and "MACs:" in text
    assert model(x).shape == (2, 10)


def test_keep_include_overrides_and_hybrid() -> None:
    model = small_cnn()
    report = pf.factorize(model, keep=["3.3.*"], overrides={"6": 4, "3.0": 0.5})
    by_name = {d.name: d for d in report.layers}
    assert "keep pattern '3.3.*'" in by_name["3.3.0"].reason
    assert by_name["6"].rank == 4 and by_name["3.0"].rank == 16
    model = small_cnn()
    report = pf.factorize(model, include=["6"])
    assert [d.name for d in report.factorized] == ["6"]
    model = small_cnn()
    report = pf.factorize(model, keep_first=2, rank=2, example_input=torch.randn(1, 1, 8, 8))
    assert {d.name for d in report.layers if "hybrid" in d.reason} == {"0", "3.0"}


def test_full_rank_factorization_preserves_function() -> None:
    model = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))
    x = torch.randn(3, 40)
    expected = model(x)
    # Full rank saves nothing, so force it: an absolute rank equal to the full rank is kept...
    with pytest.warns(UserWarning, match="changed nothing .* no parameter saving at rank 40"):
        report = pf.factorize(model, rank=40)
    assert report.factorized == []
    # ...while rank 20 of a 40x40 layer saves nothing either (20*80 == 1600): the boundary case.
    with pytest.warns(UserWarning, match="changed nothing"):
        assert pf.factorize(model, rank=20).factorized == []
    torch.testing.assert_close(model(x), expected)


def test_a_rank_ratio_written_as_an_int_is_still_a_ratio() -> None:
    """``rank_ratio=1`` is the whole rank (nothing saved), not an absolute rank of 1."""
    model = small_cnn()
    with pytest.warns(UserWarning, match="changed nothing"):
        assert pf.factorize(model, rank_ratio=1).factorized == []


def test_shared_module_is_replaced_everywhere() -> None:
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared), nn.Linear(32, 4))
    x = torch.randn(2, 32)
    report = pf.factorize(model, rank=4)
    assert model[0] is model[2][0] and isinstance(model[0], LowRankLinear)
    decision = next(d for d in report.layers if d.name == "0")
    assert decision.aliases == ["2.0"]
    model(x).sum().backward()  # one set of factor parameters, reached twice
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_unsupported_type_is_left_alone_and_reported() -> None:
    model = nn.Sequential(nn.Linear(16, 16), Custom(), nn.Embedding(10, 16))
    report = pf.factorize(model, rank=2)
    assert isinstance(model[1], Custom) and isinstance(model[2], nn.Embedding)
    reasons = {d.name: d.reason for d in report.layers}
    assert reasons["1"] == reasons["2"] == "kept: unsupported type; see pufferfish.register_low_rank"
    assert isinstance(model[0], LowRankLinear)


def test_grouped_conv_is_kept_with_reason() -> None:
    model = nn.Sequential(nn.Conv2d(16, 16, 3, groups=16), nn.Conv2d(16, 64, 3))
    report = pf.factorize(model, rank=2)
    assert "groups=16" in report.layers[0].reason
    assert isinstance(model[1], LowRankConv2d)


def test_merge_round_trip_and_idempotence() -> None:
    model = small_cnn().eval()
    x = torch.randn(2, 1, 12, 12)
    pf.factorize(model, rank_ratio=0.5)
    factored = model(x)
    with pytest.warns(UserWarning, match=r"already factorized: 5 low-rank module\(s\) \(0, 3.0"):
        assert pf.factorize(model, rank_ratio=0.5).factorized == []  # nothing left to factorize
    pf.merge(model)
    assert not any(isinstance(m, pf.LowRankModule) for m in model.modules())
    torch.testing.assert_close(model(x), factored, rtol=1e-4, atol=1e-5)


def test_state_dict_loads_into_freshly_factorized_model(tmp_path: Path) -> None:
    a, b = small_cnn(), small_cnn()
    pf.factorize(a, rank_ratio=0.25)
    pf.factorize(b, rank_ratio=0.25)
    torch.save(a.state_dict(), tmp_path / "a.pt")
    b.load_state_dict(torch.load(tmp_path / "a.pt", weights_only=True))
    x = torch.randn(2, 1, 12, 12)
    torch.testing.assert_close(a.eval()(x), b.eval()(x))


def _fashion_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    root = Path("/usr/share/datasets/fashion-mnist")
    if not root.exists():
        pytest.skip("dataset-fashion-mnist is not installed")
    with gzip.open(root / "t10k-images-idx3-ubyte.gz") as f:
        images = torch.frombuffer(bytearray(f.read()[16:16 + n * 784]), dtype=torch.uint8)
    with gzip.open(root / "t10k-labels-idx1-ubyte.gz") as f:
        labels = torch.frombuffer(bytearray(f.read()[8:8 + n]), dtype=torch.uint8)
    return images.view(n, 1, 28, 28).float() / 255, labels.long()


def test_factorized_model_trains_on_real_batch() -> None:
    x, y = _fashion_batch(64)
    model = small_cnn()
    pf.factorize(model, rank_ratio=0.25)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_count_macs_is_analytic_for_linear() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20))
    model.train()
    assert pf.count_macs(model, torch.randn(4, 10)) >= 4 * 10 * 20
    assert model.training and model[1].num_batches_tracked == 0  # counting changed nothing


@pytest.mark.parametrize("kwargs,match", [
    ({"rank_ratio": 0.0}, "rank ratio 0.0"),
    ({"rank_ratio": 1.5}, "rank ratio 1.5"),
    ({"rank": 0}, "rank 0"),
    ({"keep": ["nosuch.*"]}, "pattern 'nosuch.*' matches no module"),
    ({"include": ["9"]}, "pattern '9'"),
    ({"overrides": {"6": 0}}, "override 0"),
    ({"keep_first": -1}, "keep_first -1"),
    ({"preset": "paper"}, "Sequential has no preset 'paper'"),
])
def test_bad_input_is_a_clear_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("*", r"\*")):
        pf.factorize(small_cnn(), **kwargs)


def test_weights_on_the_meta_device_are_refused_in_one_line() -> None:
    # init_empty_weights / an offloading device_map: no values to split (was: meta factors for a
    # square layer, "cannot call item() on meta tensors" for another)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
    model[2].to("meta")
    with pytest.raises(ValueError, match=r"^parameter '2.weight' is on the meta device .*allowed"):
        pf.factorize(model)


def test_an_example_input_on_the_cpu_runs_where_the_model_is() -> None:
    """A trainer moves the model after the user built ``example_input``: the example follows
    the model's parameters; one already there stays the object it is (a move needs a GPU)."""
    from pufferfish.lowrank.counting import _on_device_of

    model = small_cnn()
    x = torch.randn(2, 1, 28, 28)
    moved = _on_device_of(model, {"a": x, "b": (x, [x])})
    assert moved["a"] is x and moved["b"][0] is x  # on its device already: untouched
    assert pf.factorize(model, example_input=x).macs_after > 0


def test_count_macs_sees_lstm_and_attention() -> None:
    lstm = nn.LSTM(16, 32, num_layers=2)
    x = torch.randn(5, 3, 16)  # (seq, batch, features)
    assert pf.count_macs(lstm, x) == 5 * 3 * 4 * 32 * ((16 + 32) + (32 + 32))
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    tokens = torch.randn(2, 7, 32)
    projections = 2 * 7 * (4 * 32 * 32 + 2 * 32 * 64)
    assert pf.count_macs(layer, tokens) >= projections  # the fused fast path is not skipped
    report = pf.factorize(layer, rank=4, example_input=tokens)
    assert report.macs_after < report.macs_before


def test_transformer_encoder_is_factorized_and_still_works() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 5, 32)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    report = pf.factorize(model, rank_ratio=0.25, keep=["layers.0.*"], example_input=x)
    factorized = {d.name for d in report.factorized}
    assert factorized == {"layers.1.self_attn", "layers.1.linear1", "layers.1.linear2"}
    assert isinstance(model.layers[1].self_attn, pf.LowRankMultiheadAttention)
    for train in (True, False):
        model.train(train)
        out = model(x, src_key_padding_mask=mask)
        assert out.shape == x.shape and torch.isfinite(out[~mask]).all()
    # At full rank the factorized encoder computes what the dense one did.
    dense = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                  num_layers=2, enable_nested_tensor=False).eval()
    expected = dense(x)
    for name in ("layers.0.self_attn", "layers.1.self_attn"):
        attn = dense.get_submodule(name)
        parent, _, child = name.rpartition(".")
        setattr(dense.get_submodule(parent), child, pf.LowRankMultiheadAttention.from_dense(attn, 32))
    torch.testing.assert_close(dense(x), expected, rtol=1e-4, atol=1e-5)


def test_lstm_inside_a_language_model() -> None:
    model = pf.models.lstm_lm(vocab_size=50, embed_dim=32, hidden_size=32, dropout=0.0)
    tokens = torch.randint(0, 50, (7, 3))
    report = pf.factorize(model, preset="paper", rank_ratio=0.25, example_input=tokens)
    assert [d.name for d in report.factorized] == ["rnn"]
    assert isinstance(model.rnn, pf.LowRankLSTM) and model.rnn.rank == 8
    assert model.decoder.weight is model.encoder.weight  # tied embeddings survive the surgery
    logits, _ = model(tokens)
    assert logits.shape == (7, 3, 50)
    # MACs of the factorized arithmetic: r·(in + 4h) per step and matrix instead of 4h·(in + h)
    # per step and layer, whichever kernel runs.
    steps = 7 * 3
    loop = 2 * 2 * steps * 8 * (32 + 4 * 32)  # two layers, two matrices each
    dense = 2 * steps * 4 * 32 * (32 + 32)
    assert report.macs_after == report.macs_before - dense + loop
    model.rnn.fused = True
    assert pf.count_macs(model, tokens) == report.macs_before - dense + loop


def test_bidirectional_lstm_is_kept_with_reason() -> None:
    model = nn.Sequential(nn.LSTM(16, 16, bidirectional=True))
    with pytest.warns(UserWarning, match="changed nothing in Sequential: 1 x a bidirectional LSTM"):
        report = pf.factorize(model, rank=2)
    assert "bidirectional" in report.layers[0].reason and isinstance(model[0], nn.LSTM)
