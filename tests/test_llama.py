"""The LLaMA-style decoder: the model, its preset, the BPE cache, packed batches, and training
under a real 2-process gloo group through the switch; HF's LlamaForCausalLM through the same
preset names and the HF callback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import cli_stderr, llama_args, metrics, run_cli, tiny_corpus

import pufferfish as pf
from pufferfish.configfile import load_config
from pufferfish.data import DataError, PackedLoader, load_bpe_corpus
from pufferfish.data import bpe as bpe_module
from pufferfish.models import build_at_width
from pufferfish.models.llama import apply_rope, rope_table
from pufferfish.training.checkpoint import latest_checkpoint

BLOCK = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def tiny_llama(vocab: int = 97, max_len: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_at_width("llama", 0.0625, vocab_size=vocab, max_len=max_len)


# -- the model ---------------------------------------------------------------------------------

def test_width_one_is_galores_llama_60m() -> None:
    model = build_at_width("llama", 1.0, vocab_size=32000, max_len=256)
    assert model.dim == 512 and len(model.layers) == 8
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.n_heads == 8 and attn.head_dim == 64
    assert mlp.gate_proj.out_features == 1376 and mlp.down_proj.in_features == 1376
    assert model.lm_head.weight is not model.embed_tokens.weight  # untied
    assert sum(p.numel() for p in model.parameters()) == 58_073_600


def test_smaller_widths_keep_heads_of_64_dims_and_too_small_is_an_error() -> None:
    model = build_at_width("llama", 0.25, vocab_size=50)
    assert model.dim == 128 and model.layers[0].self_attn.n_heads == 2
    assert model.layers[0].mlp.up_proj.out_features == 352  # 8/3 * 128 up to a multiple of 32
    with pytest.raises(ValueError, match=r"width 0\.03 is too small for llama: allowed >= 0\.0625"):
        build_at_width("llama", 0.03, vocab_size=50)


def test_shapes_and_causality() -> None:
    model = tiny_llama().eval()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 20, 97)
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 97  # a future token for positions 0..11
    with torch.no_grad():
        again = model(changed)
    torch.testing.assert_close(again[:, :12], logits[:, :12].detach(), rtol=0, atol=1e-6)
    assert not torch.allclose(again[:, 12:], logits[:, 12:].detach(), atol=1e-4)
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_len 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_rope_scores_depend_only_on_the_relative_position() -> None:
    cos, sin = rope_table(8, 64)
    q, k = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.randn(8)

    def score(i: int, j: int) -> float:
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i], sin[i]).flatten()
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j], sin[j]).flatten()
        return float(qi @ kj)

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-5)  # position 0 is no rotation


# -- the preset --------------------------------------------------------------------------------

def _expected_factorized(prefix: str, layers: int) -> set[str]:
    return {f"{prefix}layers.{i}.{name}" for i in range(1, layers) for name in BLOCK}


def test_paper_preset_factorizes_every_block_but_the_first() -> None:
    model = tiny_llama()
    report = pf.factorize(model, preset="paper", example_input=torch.zeros(1, 8, dtype=torch.long))
    assert set(report.ranks) == _expected_factorized("", 8)
    kept = {d.name for d in report.layers if not d.factorized}
    assert {f"layers.0.{name}" for name in BLOCK} | {"lm_head", "embed_tokens"} <= kept
    assert all(d.rank == d.full_rank // 4 for d in report.factorized)
    assert type(model.norm).__name__ == "RMSNorm" and model(torch.zeros(1, 4, dtype=torch.long)
                                                            ).shape == (1, 4, 97)


def test_factorize_command_prints_the_llama_report() -> None:
    result = run_cli("factorize", "--model", "llama", "--width", "0.0625", "--vocab-size", "300")
    assert result.returncode == 0, result.stderr
    assert "layers.1.mlp.gate_proj" in result.stdout and "factorized (ratio 0.25)" in result.stdout
    assert "kept: matches keep pattern '*layers.0.*'" in result.stdout


# -- the BPE cache and packed batches ----------------------------------------------------------

def test_bpe_cache_hit_and_new_entries_for_a_changed_setting_or_corpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text, cache = tiny_corpus(tmp_path), tmp_path / "cache"
    first = load_bpe_corpus(str(text), 280, cache)
    assert first.vocab_size == 280 and first.tokenizer_path.parent == cache
    assert len(list(cache.iterdir())) == 2  # tokenizer.json and tokens.pt
    eot = json.loads(first.tokenizer_path.read_text())["model"]["vocab"].get("<|endoftext|>")
    assert eot is not None and first.train[-1] == eot and first.valid[-1] == eot

    def no_training(*args: object) -> None:
        raise AssertionError("trained again on a cache hit")

    monkeypatch.setattr(bpe_module, "_train", no_training)
    hit = load_bpe_corpus(str(text), 280, cache)
    assert hit.tokenizer_path == first.tokenizer_path and torch.equal(hit.train, first.train)
    monkeypatch.undo()

    other_vocab = load_bpe_corpus(str(text), 270, cache)
    text.write_text(text.read_text().replace("w1 ", "w2 ", 3))
    other_corpus = load_bpe_corpus(str(text), 280, cache)
    paths = {first.tokenizer_path, other_vocab.tokenizer_path, other_corpus.tokenizer_path}
    assert len(paths) == 3 and all(p.exists() for p in paths)
    assert len(list(cache.iterdir())) == 6  # nothing overwritten
    with pytest.raises(DataError, match="vocab_size 1000 is larger than the corpus allows"):
        load_bpe_corpus(str(text), 1000, cache)


def test_the_bpe_cache_goes_to_the_cache_dir_never_beside_a_read_only_corpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache is $XDG_CACHE_HOME/pufferfish, so a corpus in a read-only folder
    works and its folder gains nothing; an entry an older version wrote beside the corpus is
    still a hit (same name, same digest) and nothing is written there."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    text = tiny_corpus(folder)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder.chmod(0o555)  # read-only (root writes anyway: then the listing below decides)
    try:
        corpus = load_bpe_corpus(str(text), 280)
        assert corpus.tokenizer_path.parent == tmp_path / "xdg" / "pufferfish"
        assert [p.name for p in folder.iterdir()] == ["corpus.txt"]
    finally:
        folder.chmod(0o755)
    for path in (corpus.tokenizer_path, corpus.tokenizer_path.with_name(
            corpus.tokenizer_path.name.replace(".tokenizer.json", ".tokens.pt"))):
        path.rename(folder / path.name)  # where an older version left them
    monkeypatch.setattr(bpe_module, "_train", lambda *a: pytest.fail("trained on a cache hit"))
    old = load_bpe_corpus(str(text), 280)
    assert old.tokenizer_path.parent == folder and torch.equal(old.train, corpus.train)
    assert not any((tmp_path / "xdg" / "pufferfish").iterdir())


def test_validation_shares_no_verse_with_training(tmp_path: Path) -> None:
    lines = [f"verse {i} " + "x" * (i % 7) for i in range(300)]
    text = tmp_path / "verses.txt"
    text.write_text("\n".join(lines) + "\n")
    corpus = load_bpe_corpus(str(text), 260, tmp_path / "cache")
    from tokenizers import Tokenizer

    decode = Tokenizer.from_file(str(corpus.tokenizer_path)).decode
    train = set(decode(corpus.train.tolist(), skip_special_tokens=False).split("<|endoftext|>"))
    valid = set(decode(corpus.valid.tolist(), skip_special_tokens=False).split("<|endoftext|>"))
    assert len(valid - {""}) == 15 and not (valid - {""}) & train


def test_packed_batches_shard_disjointly_with_equal_steps() -> None:
    ids = torch.arange(1001)
    loaders = [PackedLoader(ids, 10, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == 12  # 100 windows // (4 * 2)
    seen = [x[:, 0] for loader in loaders for x, _ in loader]
    starts = torch.cat(seen)
    assert starts.unique().numel() == starts.numel() == 96
    x, y = next(iter(loaders[0]))
    assert x.shape == (4, 10) and torch.equal(y, x + 1)  # targets are the next tokens


# -- training: 2 processes through the switch, and bad input -----------------------------------


def test_two_process_llama_switches_and_reports_validation_perplexity(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("train", *llama_args(tmp_path, "--epochs", "2", "--warmup-epochs", "1",
                                          "--eval-every-steps", "10", "--out", str(out)),
                     torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["lowrank"] for r in rows] == [False, True]
    assert rows[1]["params"] < rows[0]["params"]
    for row in rows:
        assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-6)
        assert row["val_ppl"] < 280 and row["tokens_per_s"] > 0
        assert row["comm_bytes_per_step"] == pytest.approx(4 * row["params"], rel=0.01)
    factorized = json.loads((out / "factorization.json").read_text())
    assert "layers.1.self_attn.q_proj" in json.dumps(factorized)
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["step"] % 10 == 0 and "val_ppl" in e for e in evals)
    assert "val_ppl" in result.stdout and result.stdout.count("epoch 1/2 |") == 1
    report = run_cli("report", str(out))
    # The reported figure: the test split's, evaluated after the last epoch only.
    assert report.returncode == 0 and "final test ppl" in report.stdout, report.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--width", "0.01"], "width 0.01 is too small for llama: allowed >= 0.0625"),
    (["--seq-len", "5000"], "--seq-len 5000 is out of range for llama: allowed 1 to 4096"),
    (["--seq-len", "2000"], "sequences of 2000 tokens are too few for a batch of 4"),
    (["--vocab-size", "5000"], "--vocab-size 5000 is larger than the corpus allows"),
    (["--vocab-size", "100"], "--vocab-size 100 is too small for a byte-level BPE"),
    (["--data", "fashion-mnist"], "data 'fashion-mnist' is no text corpus: allowed kjv"),
])
def test_bad_llama_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    # in this process (a real one's exit: tests/test_reliability.py's one-line checks)
    code, lines = cli_stderr(["train", *llama_args(tmp_path, *args, "--out",
                                                   str(tmp_path / "run"))], capfd)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("pufferfish: error:") and message in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- Hugging Face LlamaForCausalLM: the same preset names, the HF callback ------------------------

def tiny_hf_llama(layers: int = 3) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from hf_trainer_run import VOCAB

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_hf_llama_takes_the_paper_preset_by_its_class_name() -> None:
    model = tiny_hf_llama()
    report = pf.factorize(model, preset="paper", example_input=torch.zeros(1, 8, dtype=torch.long))
    assert set(report.ranks) == _expected_factorized("model.", 3)
    kept = {d.name for d in report.layers if not d.factorized}
    assert {f"model.layers.0.{name}" for name in BLOCK} | {"lm_head"} <= kept


def test_hf_trainer_callback_switches_hf_llama_with_the_paper_preset(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    import transformers
    from hf_trainer_run import Tokens, training_arguments

    from pufferfish.integrations.hf import PufferfishCallback
    from pufferfish.lowrank import LowRankModule

    model = tiny_hf_llama()
    callback = PufferfishCallback(preset="paper", verbose=False)  # the preset's warm-up: none
    trainer = transformers.Trainer(model=model, args=training_arguments(str(tmp_path),
                                                                        num_train_epochs=2),
                                   train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    assert callback.recipe.switched_at == 0
    assert set(callback.report.ranks) == _expected_factorized("model.", 3)
    low = {n for n, m in model.named_modules() if isinstance(m, LowRankModule)}
    assert low == _expected_factorized("model.", 3)
    # The Trainer's optimizer trains the factors: they are in it, the replaced weights are not.
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in in_optimizer for p in model.parameters())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(v) for v in losses)


def test_callbacks_and_recipe_by_default_take_the_presets_keep_list_with_its_warm_up() -> None:
    """A preset found by class name is the model's default everywhere: the callbacks' core
    and Recipe given no preset keep what ``factorize(preset="paper")`` keeps (lm_head, the
    first block), not only the preset's warm-up; ``preset=None`` asks for neither."""
    from pufferfish.integrations.core import TrainerSwitch

    def factorized(**given: object) -> tuple[object, set[str]]:
        model = tiny_hf_llama()
        switch = TrainerSwitch(verbose=False, **given)
        switch.start(model, 0.0, resumed=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        switch.switch(0, 0, model, [optimizer], None)
        return switch.recipe.warmup_epochs, set(switch.recipe.report.ranks)

    assert factorized() == (0, _expected_factorized("model.", 3))
    warmup, none = factorized(preset=None)
    assert warmup == 2 and {"lm_head", "model.layers.0.mlp.up_proj"} <= none
    model = tiny_hf_llama()
    recipe = pf.Recipe(warmup_epochs=0)
    recipe.on_epoch_start(0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert set(recipe.report.ranks) == _expected_factorized("model.", 3)
    with pytest.raises(ValueError, match="has no preset 'papr': allowed paper, 'default' or None"):
        pf.factorize(tiny_hf_llama(), preset="papr")


def test_the_llama_preset_sets_the_warm_up_only_where_the_user_did_not() -> None:
    """LLaMA-style decoders train low rank from the start by default (the CLI's --model llama
    too); a warm-up the user gives is kept, and a model without its own keeps the default 2."""
    from pufferfish.integrations.core import TrainerSwitch

    def warmup(model: torch.nn.Module, **given: object) -> object:
        switch = TrainerSwitch(verbose=False, **given)
        switch.start(model, 0.0, resumed=False)
        return switch.recipe.warmup_epochs

    llama = tiny_hf_llama(layers=2)
    assert warmup(llama) == 0 and warmup(llama, warmup_epochs=1) == 1
    assert warmup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))) == 2
    when = pf.switch.SwitchSchedule.from_config
    assert when(load_config(overrides={"model": "llama"})).switch_epoch == 0
    assert when(load_config(overrides={"model": "llama", "warmup_epochs": "1"})).switch_epoch == 1
    assert load_config(overrides={"model": "resnet18"}).warmup_epochs == "10%"


def test_resume_after_the_switch_replays_the_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    args = llama_args(tmp_path, "--train-subset", "800", "--epochs", "2", "--warmup-epochs", "1",
                      "--checkpoint-every-steps", "4", "--eval-every-steps", "5")
    ref, run, marker = tmp_path / "ref", tmp_path / "run", tmp_path / "killed"
    assert run_cli("train", *args, "--out", str(ref)).returncode == 0
    killed = run_cli("train", *args, "--out", str(run), env={
        "PUFFERFISH_KILL_AT_STEP": "17", "PUFFERFISH_KILL_MARKER": str(marker)})
    assert killed.returncode == -9 and marker.exists()
    for flag, value, saved in (("--seq-len", "8", "16"), ("--vocab-size", "300", "280")):
        code, lines = cli_stderr(["train", "--resume", str(run), flag, value, "--no-progress"],
                                 capfd)  # in this process
        assert code == 2, lines  # other tokens for the saved model
        assert f"{flag}: checkpoint has {saved}, this run has {value}" in "\n".join(lines)
    resumed = run_cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    a, b = latest_checkpoint(ref)[0]["model"], latest_checkpoint(run)[0]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["val_ppl"] for r in metrics(ref)] == [r["val_ppl"] for r in metrics(run)]
    evals = [(tmp_path / d / "evals.jsonl").read_text() for d in ("ref", "run")]
    assert [json.loads(x)["step"] for x in evals[1].splitlines()] == \
        [json.loads(x)["step"] for x in evals[0].splitlines()]
