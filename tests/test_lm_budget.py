"""The language-model budget: the kjv+gcide corpus, its split, --tokens-per-param, test perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import cli_stderr, metrics, run_cli, tiny_corpus

from pufferfish.config import ConfigError, TrainConfig
from pufferfish.data import bpe as bpe_module
from pufferfish.data.bpe import load_bpe_corpus, split_documents
from pufferfish.data.gcide import GCIDE_DIR, clean_entry, load_gcide
from pufferfish.distributed.env import DistEnv
from pufferfish.training.budget import full_rank_params, resolve_token_budget

needs_gcide = pytest.mark.skipif(not (GCIDE_DIR / "gcide.dict.dz").is_file(),
                                 reason="dict-gcide not installed (make data)")


def test_gcide_markup_is_stripped_and_the_text_kept() -> None:
    entry = ('Allhallow \\All`hal"low\\, n.\n   1. All the saints [Obs.]\n   [1913 Webster]\n'
             '   See {Halloween}; pr[ae]tor, m[=e]te, [WordNet 1.5 +PJC]\n')
    assert clean_entry(entry) == ("Allhallow, n. 1. All the saints [Obs.] See Halloween; "
                                  "praetor, mete,")


@needs_gcide
def test_the_real_dictionary_is_about_five_million_words_of_plain_text() -> None:
    entries = load_gcide()
    assert len(entries) > 120_000
    assert 4_500_000 < sum(len(e.split()) for e in entries) < 6_000_000
    sample = entries[::500]
    assert not any("[1913 Webster]" in e or "\\" in e or "{" in e for e in sample)
    assert not any(e.startswith("00-database") for e in entries[:10])


def test_documents_split_per_source_with_repeats_kept_out_of_validation_and_test() -> None:
    verses = [f"verse {i}" for i in range(200)]
    entries = [f"entry {i}" for i in range(100)] + ["Syn: same"] * 100  # a repeated passage
    train, valid, test = split_documents([verses, entries], dedupe=True)
    assert not set(train) & set(valid) and not set(train) & set(test)
    assert not set(valid) & set(test)
    assert "Syn: same" in train and "Syn: same" not in valid + test
    assert sum(v.startswith("verse") for v in valid) == 10  # 5% of each source
    kept = split_documents([verses, entries], dedupe=False)
    assert "Syn: same" in kept[1]  # without dedupe the split is the plain interleaved one


def test_the_tokenizer_is_trained_on_the_training_documents_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = tiny_corpus(tmp_path)
    seen: list[list[str]] = []
    real_train = bpe_module._train

    def recording(tokenizers: object, lines: list[str], vocab: int) -> object:
        seen.append(list(lines))
        return real_train(tokenizers, lines, vocab)

    monkeypatch.setattr(bpe_module, "_train", recording)
    load_bpe_corpus(str(text), 280, tmp_path / "cache")
    train, valid, test = bpe_module._split(text.read_text().splitlines())
    assert seen == [train] and valid and test


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", "llama", "--width", "0.0625", "--data", str(tiny_corpus(tmp_path)),
            "--cache-dir", str(tmp_path / "cache"), "--vocab-size", "280", "--seq-len", "16",
            "--batch-size", "8", "--lr", "0.01", "--threads", "1", "--no-progress", *extra]


def test_tokens_per_param_gives_every_mode_the_same_tokens_and_a_test_perplexity(
        tmp_path: Path) -> None:
    steps = {}
    for mode in ("full", "pufferfish"):
        out = tmp_path / mode
        result = run_cli("train", *_args(tmp_path, "--mode", mode, "--tokens-per-param", "0.02",
                                         "--warmup-steps", "0.5" if mode == "pufferfish" else "0",
                                         "--out", str(out)))
        assert result.returncode == 0, result.stderr[-2000:]
        rows = metrics(out)
        steps[mode] = sum(r["steps"] for r in rows)
        last = rows[-1]
        assert last["test_ppl"] == pytest.approx(math.exp(last["test_loss"]), rel=1e-6)
        assert last["test_ppl"] != last["val_ppl"]  # the test split, not validation again
        assert all("test_ppl" not in r for r in rows[:-1])  # reported once, at the end
        assert "tokens_per_param = 0.02" in (out / "config.toml").read_text()
    cfg = TrainConfig(model="llama", width=0.0625, vocab_size=280, seq_len=16)
    budget = math.ceil(0.02 * full_rank_params(cfg, 280))
    assert len(set(steps.values())) == 1  # equal tokens whatever the mode
    assert abs(steps["full"] * 16 * 8 - budget) <= 2 * 16 * 8  # the budget, to a step's tokens


def test_a_budget_past_the_epochs_allowed_is_refused_in_one_line(tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    code, lines = cli_stderr(["train", *_args(tmp_path, "--tokens-per-param", "50", "--epochs",
                                              "1", "--out", str(tmp_path / "run"))], capfd)
    assert code == 2
    assert len(lines) == 1 and "--tokens-per-param 50" in lines[0] and "--epochs 1" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_tokens_per_param_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="tokens_per_param"):
        TrainConfig(model="llama", width=0.0625, tokens_per_param=float(value))


def test_tokens_per_param_is_for_llama_only() -> None:
    env = DistEnv()
    with pytest.raises(ConfigError, match="tokens_per_param is for --model llama"):
        resolve_token_budget(TrainConfig(model="resnet18", tokens_per_param=1), env)


def test_the_lr_ramps_up_again_after_the_switch_with_switch_lr_warmup() -> None:
    from pufferfish.method import PufferfishMethod

    cfg = TrainConfig(model="llama", width=0.0625, epochs=2, warmup_epochs="1",
                      switch_lr_warmup=4)
    method = PufferfishMethod(cfg)
    assert method.lr_scale(12, 10) == 1.0  # not switched yet
    method.switch.policy.switched_at = 1  # switched before epoch 1 = global step 10
    assert [method.lr_scale(s, 10) for s in (10, 11, 13, 14, 19)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    in_steps = PufferfishMethod(TrainConfig(model="llama", width=0.0625, epochs=1,
                                            warmup_steps=0.5, switch_lr_warmup=0.1))
    in_steps.switch.policy.switched_at = 0
    assert [in_steps.lr_scale(s, 100) for s in (50, 55, 59, 60)] == [0.1, 0.6, 1.0, 1.0]
    with pytest.raises(ConfigError, match="switch_lr_warmup"):
        TrainConfig(switch_lr_warmup=-1)


@pytest.mark.parametrize("flags,state,rewarm", [
    ({"model": "llama"}, "reset", 0.05),  # AdamW after the LR warm-up: fresh moments, re-warmed
    ({"model": "llama", "lr_warmup_epochs": 0.6}, "reset", 0.0),  # inside it: the schedule ramps
    ({"model": "llama", "switch_lr_warmup": 8}, "reset", 8),  # the user's re-warm-up wins
    ({"model": "llama", "switch_momentum": "reset"}, "reset", 0.0),  # as asked: no re-warm-up
    ({"model": "llama", "switch_momentum": "project"}, "project", 0.0),
    ({"model": "llama", "optimizer": "sgd"}, "reset", 0.0),  # SGD: the paper's reset
    ({"model": "resnet18"}, "reset", 0.0),  # the image models' recipe unchanged
])
def test_switch_momentum_auto_resets_and_rewarms_adam_after_the_lr_warm_up(
        flags: dict, state: str, rewarm: float) -> None:
    from pufferfish.method import PufferfishMethod

    cfg = TrainConfig(epochs=1, warmup_steps=0.5, **flags)  # the switch before step 50 of 100
    method = PufferfishMethod(cfg)
    assert (method.schedule.carry, method.schedule.rewarm(50, 100)) == (state, rewarm)
    method.switch.policy.switched_at = 0
    width = round(rewarm * 100) if rewarm < 1 else int(rewarm)
    assert method.lr_scale(50, 100) == (1 / width if rewarm else 1.0)
    assert method.lr_scale(50 + width, 100) == 1.0
