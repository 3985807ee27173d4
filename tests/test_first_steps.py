"""The first steps from a wheel: `pufferfish --help` shows what to run first and points at no
file outside the package, `--version`, a bare `train` asks for a choice, and a short try shows
its progress over the whole run, evaluates in proportion and ends with its result."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
from helpers import needs_fashion, run_cli

import pufferfish
from pufferfish.cli import _parser, main
from pufferfish.configfile import load_config


def _all_help() -> str:
    parser = _parser()
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [sub.format_help() for sub in action.choices.values()]
    return "\n".join(texts)


def test_help_shows_three_first_commands_and_no_file_outside_the_wheel() -> None:
    top = _parser().format_help()
    first = top.split("first steps:", 1)[1]
    commands = re.findall(r"^  pufferfish (\w+)", first, flags=re.M)
    assert commands == ["train", "factorize", "report"]
    assert "the tokenizers package (the [lm] extra)" in " ".join(top.split())
    text = _all_help()
    assert "docs/" not in text and "MODEL_DEFAULTS" not in text and "make " not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"pufferfish {pufferfish.__version__} (torch ")


def test_a_bare_train_asks_for_a_choice_in_one_line(tmp_path: Path) -> None:
    """A process with a timeout: were it to start the defaults, it would train for hours."""
    result = run_cli("train", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "no --config, --model or --epochs given" in err[0]
    assert "pufferfish train --config resnet18_fashion --epochs 1 --train-subset 512" in err[0]
    assert not (tmp_path / "runs").exists()  # nothing started


def test_train_subset_alone_shrinks_the_evaluation_and_says_so() -> None:
    from pufferfish.training.tasks import resolve_short_try

    cfg = load_config(None, {"train_subset": 512})
    short, said = resolve_short_try(cfg, {"train_subset"})
    assert short.test_subset == 1000 and "--test-subset 1000" in said
    assert resolve_short_try(load_config(None, {"train_subset": 20_000}), {"train_subset"}
                             )[0].test_subset == 4000
    given = load_config(None, {"train_subset": 512, "test_subset": 64})
    assert resolve_short_try(given, {"train_subset", "test_subset"}) == (given, None)
    assert resolve_short_try(cfg, set()) == (cfg, None)  # a TOML's subset: as written
    assert resolve_short_try(load_config(None, {"train_subset": 60_000 - 5000}),
                             {"train_subset"})[1] is None  # evaluates everything anyway


@needs_fashion
def test_a_short_try_shows_the_whole_run_and_ends_with_its_result(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "--model", "resnet18", "--width", "0.125", "--train-subset", "128",
                 "--val-subset", "64", "--batch-size", "32", "--epochs", "2",
                 "--eval-batch-size", "500", "--threads", "1", "--progress",
                 "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "a short try: --train-subset 128 also evaluates only the first 1000" in out
    assert "test_subset = 1000" in (run / "config.toml").read_text()
    bars = err.replace("\r", "\n")
    assert re.search(r"epoch 2/2[^\n]*\| 8/8 ", bars)  # one bar over both epochs' 4 steps
    assert re.search(r"  test: [^\n]*\d/2 ", bars)  # 1000 test images in batches of 500 (the
    # count it reaches before the bar is cleared depends on its refresh interval, not checked)
    lines = out.splitlines()
    assert lines[-1].startswith("done: test_acc ") and f"run directory: {run}" in lines[-1]
    table = [line for line in lines if "factorized (ratio 0.25)" in line]
    assert table and not any("\r" in line or "it/s" in line or "step/s" in line
                             for line in table)


@needs_fashion
def test_download_reads_the_images_where_it_put_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --download` without --data-dir fetches into ./data and must read from there, not
    from the system's default folder (absent on a machine without the Debian package). The files
    are already in ./data here (Debian's copies, compressed anew: their checksums are not the
    official ones, so none is checked), so nothing is fetched."""
    import shutil

    from helpers import FASHION

    from pufferfish.data import images

    shutil.copytree(FASHION, tmp_path / "data")
    load, _, classes, padding = images._SOURCES["fashion-mnist"]
    monkeypatch.setitem(images._SOURCES, "fashion-mnist",
                        (load, tmp_path / "no-system-copy", classes, padding))
    fetcher = sys.modules["pufferfish.data.download"]  # the module (the package exports its function)
    monkeypatch.setattr(fetcher, "FASHION_MNIST_MD5", {})
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "resnet18", "--width", "0.125", "--train-subset", "64",
                 "--val-subset", "64", "--test-subset", "64", "--batch-size", "32",
                 "--epochs", "1", "--threads", "1", "--no-progress", "--download",
                 "--out", str(tmp_path / "run")]) == 0
