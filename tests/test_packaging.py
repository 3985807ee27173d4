"""The wheel: a LICENSE, the license as an SPDX expression, the shipped configs, no build
warnings; installed in a clean virtualenv, it runs the README's examples and
``pufferfish train --config resnet18_fashion`` outside the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import TINY, block_kind, metrics, needs_fashion, python_blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (no build/ left in the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("pufferfish", "configs"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    noise = [line for line in (build.stdout + build.stderr).splitlines()
             if "warn" in line.lower() and "byte-compiling is disabled" not in line]
    assert not noise, noise
    (path,) = out.glob("pufferfish-*.whl")
    return path


def test_the_wheel_holds_the_license_and_the_configs(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    shipped = {Path(n).name for n in names if n.startswith("pufferfish/configs/")}
    assert shipped == {p.name for p in (ROOT / "configs").glob("*.toml")}
    assert "resnet18_fashion.toml" in shipped
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


@needs_fashion
def test_installed_in_a_clean_virtualenv_it_runs_from_anywhere(wheel: Path,
                                                                tmp_path: Path) -> None:
    """The wheel in a fresh virtualenv (its dependencies, torch included, from this one's
    site-packages, never this checkout): --help, the README's library examples and a shipped
    config by name, from a directory outside the source tree."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    work = tmp_path / "work"
    work.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work,
                              timeout=300)

    where = run(str(venv / "bin" / "python"), "-c", "import pufferfish; print(pufferfish.__file__)")
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    assert run(str(venv / "bin" / "pufferfish"), "--help").returncode == 0
    examples = [b for b in python_blocks() if block_kind(b) == "plain"]
    library = run(str(venv / "bin" / "python"), "-c", "\n".join(examples))
    assert library.returncode == 0, library.stderr[-2000:]
    train = run(str(venv / "bin" / "pufferfish"), "train", "--config", "resnet18_fashion", *TINY,
                "--epochs", "1", "--out", "run")
    assert train.returncode == 0, train.stderr[-2000:]
    assert len(metrics(work / "run")) == 1
    # the repository's path works too, from anywhere (the README's commands as written)
    found = run(str(venv / "bin" / "python"), "-c", "from pufferfish.configfile import config_path; "
                "print(config_path('configs/resnet18_fashion.toml'))")
    assert found.stdout.strip() == str(site / "pufferfish/configs/resnet18_fashion.toml")
    bad = run(str(venv / "bin" / "pufferfish"), "train", "--config", "resnet19")
    assert bad.returncode == 2 and "shipped config: demo, lstm_kjv" in bad.stderr
