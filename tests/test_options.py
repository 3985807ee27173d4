"""The options by concern: TrainConfig is its option groups (fields in their order, each group's
own checks), a TOML file may put keys in their group's table and reads the same as a flat one,
the run directory's config.toml stays flat, and the bench shares the groups it has."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
from helpers import cli

from pufferfish.bench.config import BenchConfig
from pufferfish.config import ConfigError, TrainConfig
from pufferfish.configfile import FIELDS, dump_toml, load_config, shipped_configs
from pufferfish.fieldhelp import field_help
from pufferfish.options import (
    GROUPS,
    BatchOptions,
    ModelOptions,
    OptimizerOptions,
    SubsetOptions,
    section_of,
    sections,
)


def _sectioned(flat_toml: str) -> str:
    """The same key lines (one line each, as the shipped files have them), each under its group's
    table, the comments left out."""
    by_table: dict[str, list[str]] = {}
    for line in flat_toml.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            by_table.setdefault(section_of(line.split("=")[0].strip()), []).append(line)
    return "".join(f"[{table}]\n" + "\n".join(lines) + "\n\n" for table, lines in by_table.items())


def test_the_fields_are_the_groups_in_order_each_in_one_table() -> None:
    assert list(FIELDS) == [f.name for g in GROUPS for f in dataclasses.fields(g)]
    tables = sections()
    keys = [k for ks in tables.values() for k in ks]
    assert sorted(keys) == sorted(FIELDS) and len(keys) == len(set(keys))
    # A table named like a key would clash with that key at the top level of a TOML file.
    assert not set(tables) & set(FIELDS)
    assert section_of("lr") == "optim" and section_of("warmup_epochs") == "switch"
    assert section_of("powersgd_rank") == "distributed"  # the comm hooks' options, after comm


def test_each_group_checks_its_own_fields_with_the_same_message() -> None:
    with pytest.raises(ConfigError, match=r"^lr 0 is invalid: allowed a number > 0$"):
        OptimizerOptions.check_group(OptimizerOptions(lr=0))
    with pytest.raises(ConfigError, match=r"^optimizer 'adam' is invalid: allowed auto, sgd, "
                                          r"adamw$"):
        OptimizerOptions.check_group(OptimizerOptions(optimizer="adam"))
    with pytest.raises(ConfigError, match=r"^lr 0 is invalid: allowed a number > 0$"):
        TrainConfig(lr=0)
    OptimizerOptions.check_group(TrainConfig(lr=0.5))  # a group checks its part of a config


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_a_sectioned_file_reads_as_the_flat_one(name: str, tmp_path: Path) -> None:
    flat = shipped_configs()[name]
    sectioned = tmp_path / f"{name}.toml"
    sectioned.write_text(_sectioned(flat.read_text()))
    assert "[" in sectioned.read_text()
    assert load_config(sectioned).to_dict() == load_config(flat).to_dict()
    # A flag still overrides a key given in a table.
    assert load_config(sectioned, {"lr": "0.5"}).lr == 0.5


def test_mixed_top_level_and_tables(tmp_path: Path) -> None:
    path = tmp_path / "mixed.toml"
    path.write_text('model = "vgg19_bn"\nepochs = 4\n\n[optim]\nlr = 0.05\nmomentum = 0.8\n\n'
                    '[switch]\nwarmup_epochs = "1"\n')
    cfg = load_config(path)
    assert (cfg.model, cfg.epochs, cfg.lr, cfg.momentum, cfg.warmup_epochs) == (
        "vgg19_bn", 4, 0.05, 0.8, "1")


@pytest.mark.parametrize(("text", "message"), [
    ("[optim]\nepochs = 3\n", "epochs in [optim] is in the wrong section: allowed in "
                              "[training] or without a section"),
    ("[optimizer]\nlr = 3.0\n", "section [optimizer] is unknown (did you mean [optim]?): "
                                "allowed [network], [dataset], [method], [switch], [baselines], "
                                "[training], [optim], [lm], [distributed], [run], or keys "
                                "without a section"),
    ("lr = 0.1\n[optim]\nlr = 0.2\n", "lr is given twice (again in [optim]): allowed once"),
    ("[optim]\nlrr = 0.2\n", "unknown configuration key 'lrr' (did you mean 'lr'?)"),
    ("[optim]\nlr = \"fast\"\n", "lr 'fast' is invalid: allowed a float"),
])
def test_a_bad_table_is_refused_in_one_line(text: str, message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a run would make runs/
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, out, err = cli(["train", "--config", str(path)], capsys)
    assert code == 2 and out == ""
    assert err == f"pufferfish: error: config file {str(path)!r}: {message}\n"
    assert list(tmp_path.iterdir()) == [path]  # nothing made


def test_config_toml_stays_flat_and_reads_back() -> None:
    cfg = load_config(overrides={"lr": "0.05", "keep": "layer4.*", "comm": "powersgd"})
    written = dump_toml(cfg)
    assert "[" not in "".join(line.split("=")[0] for line in written.splitlines())
    assert list(tomllib.loads(written)) == list(FIELDS)


def test_the_bench_shares_the_groups_it_has() -> None:
    for group in (ModelOptions, BatchOptions, SubsetOptions):
        assert issubclass(BenchConfig, group)
        for f in dataclasses.fields(group):
            assert field_help(BenchConfig)[f.name] == field_help(TrainConfig)[f.name]
    bench, train = BenchConfig(), TrainConfig()
    assert (bench.width, train.width) == (0.5, 1.0)  # the bench's one other default
    for name in ("model", "batch_size", "grad_accum", "val_subset", "train_subset", "test_subset"):
        assert getattr(bench, name) == getattr(train, name)
    bench.train_subset = -1
    with pytest.raises(ValueError, match=r"^train_subset -1 is invalid: allowed >= 0$"):
        bench.validate()


def test_train_help_lists_the_flags_under_their_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["train", "--help"], capsys)
    assert code == 0
    headings = [out.index(f"{table} options (a --config file's [{table}]):") for table in sections()]
    assert headings == sorted(headings)  # in the groups' order
    for table, keys in sections().items():
        start = out.index(f"[{table}]):")
        end = min([h for h in headings if h > start] + [len(out)])
        for key in keys:
            assert f"\n  --{key.replace('_', '-')}" in out[start:end], (table, key)
