"""`pufferfish bench` on language models: full rank, Pufferfish and GaLore timed by the step worker
on KJV token batches in a real 2-process gloo group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import free_port

from pufferfish.bench.config import BenchConfig

pytest.importorskip("pytorch_optimizer")


@pytest.mark.skipif(not shutil.which("bible"), reason="bible-kjv missing")
def test_step_worker_times_ddp_pufferfish_and_galore_on_a_transformer(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "pufferfish.bench.step",
           "--methods", "ddp,pufferfish,galore", "--model", "transformer", "--width", "0.125",
           "--batch-size", "4", "--seq-len", "16", "--steps", "2", "--warmup", "2",
           "--compute-steps", "1", "--threads", "1", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["method"]: r for r in json.loads(out.read_text())}
    ddp, puffer, galore = records["ddp"], records["pufferfish"], records["galore"]
    assert galore["params"] == ddp["params"] and not galore["factorized"]
    assert galore["bytes_per_step"] == ddp["bytes_per_step"]  # GaLore ships full gradients
    assert puffer["bytes_per_step"] < 0.85 * ddp["bytes_per_step"]  # 0.80 at this width
    assert all(r["step_time"] > 0 for r in records.values())


def test_bench_config_takes_language_models_for_step_times_only() -> None:
    BenchConfig(model="transformer", methods=["ddp", "galore"]).validate()
    with pytest.raises(ValueError, match="--train and --accuracy-runs are for the image models"):
        BenchConfig(model="transformer", methods=["ddp"], train=True).validate()
    with pytest.raises(ValueError, match="model 'alexnet' is invalid for the benchmark"):
        BenchConfig(model="alexnet").validate()
