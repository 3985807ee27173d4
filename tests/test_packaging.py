"""The wheel: a LICENSE, the license as an SPDX expression, the shipped configs, no build
warnings, and ``pufferfish train --config resnet18_fashion`` from its files outside the source
tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_training import TINY, metrics, needs_fashion

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
def test_a_shipped_config_by_name_from_the_installed_files(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import pufferfish; print(pufferfish.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    run = subprocess.run([sys.executable, "-m", "pufferfish", "train", "--config",
                          "resnet18_fashion", *TINY, "--epochs", "1", "--out", "run"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(metrics(tmp_path / "run")) == 1
    # the repository's path works too, from anywhere (the README's commands as written)
    found = subprocess.run([sys.executable, "-c", "from pufferfish.config import config_path; "
                            "print(config_path('configs/resnet18_fashion.toml'))"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert found.stdout.strip() == str(site / "pufferfish/configs/resnet18_fashion.toml")
    bad = subprocess.run([sys.executable, "-m", "pufferfish", "train", "--config", "resnet19"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "shipped config: demo, lstm_kjv" in bad.stderr
