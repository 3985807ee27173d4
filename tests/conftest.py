"""Shared fixtures: one torch thread, a fixed seed, and uninterrupted reference runs."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import run_cli

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``uninterrupted(args, nproc=2)``: the run directory of ``pufferfish train ARGS`` under
    torchrun on ``nproc`` processes, trained once per session and shared by the tests that compare
    with it (a resumed run must end where it ends)."""

    done: dict[tuple[tuple[str, ...], int], Path] = {}

    def run(args: list[str], nproc: int = 2) -> Path:
        key = (tuple(args), nproc)
        if key not in done:
            out = tmp_path_factory.mktemp("uninterrupted") / "run"
            result = run_cli("train", *args, "--out", str(out), torchrun=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            done[key] = out
        return done[key]

    return run


# In CI (CI=true) every dependency is installed (`make test` installs the data, runs as root and
# can make network namespaces), so a test skipped there would pass by not running: it fails
# instead, naming the skip's reason. Only a test that needs hardware CI never has (a GPU) may skip.
HARDWARE_SKIPS = ("cuda", "gpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not any(word in reason.lower() for word in HARDWARE_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where it must run: {reason}"
