"""``pufferfish bench`` under FSDP2: the ``fsdp`` and ``pufferfish+fsdp`` methods timed by a real
2-process gloo group over loopback, and ``--parallel fsdp``'s mapping and refusals."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import BENCH_TINY, DDP_ROWS, PUFF_ROWS, needs_fashion, write_train_run

from pufferfish.bench import accuracy as acc
from pufferfish.bench import projection as proj
from pufferfish.bench.config import BenchConfig
from pufferfish.bench.runner import _train_argv
from pufferfish.bench.workload import build_model
from pufferfish.cli import main
from pufferfish.distributed.fsdp import fsdp_units

ALL4 = "ddp,pufferfish,fsdp,pufferfish+fsdp"


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """DDP and FSDP2, full rank and Pufferfish, in one loopback worker group."""
    out = tmp_path_factory.mktemp("bench-fsdp")
    assert main(["bench", *BENCH_TINY, "--methods", ALL4, "--rounds", "1", "--steps", "2",
                 "--compute-steps", "1", "--bucket-mb", "torch",  # DDP's bucket trial: test_bench.py's
                 "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def _fsdp_bytes(factorized: bool, p: int = 2) -> tuple[int, int]:
    """(all-gather, reduce-scatter) bytes of one FSDP2 step from the model's parameter shapes:
    each parameter padded to ``p`` rows' multiple; a block's shard gathered in forward and again
    in backward, the root's once; every gradient reduce-scattered (float32)."""
    args = argparse.Namespace(model="resnet18", width=0.125, seed=0, channels_last=False,
                              compile=False, vocab=2000, seq_len=64)
    model, _ = build_model(args, factorized)

    def shard(t: Any) -> int:
        return 4 * math.ceil(t.shape[0] / p) * (t.numel() // t.shape[0])

    in_units = {id(q) for name in fsdp_units(model)
                for q in model.get_submodule(name).parameters()}
    gather = sum((2 if id(q) in in_units else 1) * shard(q) for q in model.parameters())
    return gather, sum(p * shard(q) for q in model.parameters())


@needs_fashion
def test_fsdp_records_and_their_bytes(side_by_side: tuple[dict[str, Any], str]) -> None:
    result, _ = side_by_side
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(ALL4.split(","))
    for method in ("fsdp", "pufferfish+fsdp"):
        r = rows[method]
        assert (r["parallel"], r["hook"], r["bucket_mib"], r["compress_time"]) == \
            ("fsdp", "fsdp2", None, 0.0)
        assert r["step_time"] > 0 and r["compute_time"] > 0
        assert r["bytes_per_step"] == \
            r["all_gather_bytes_per_step"] + r["reduce_scatter_bytes_per_step"]
        # What the sharded model moves, derived here from the parameter shapes.
        assert (r["all_gather_bytes_per_step"], r["reduce_scatter_bytes_per_step"]) == \
            _fsdp_bytes(r["factorized"])
        assert r["ring_bytes_per_step"] == pytest.approx(
            r["all_gather_bytes_per_step"] + r["reduce_scatter_bytes_per_step"] / 2)
        assert r["collectives_per_step"] == 3 * 8 + 2  # 8 blocks: 2 gathers + 1 scatter; root
        # Each process holds half of the parameters, gradients and momentum (padded rows).
        assert r["shard_param_bytes"] == r["shard_grad_bytes"] == r["shard_optimizer_bytes"]
        assert 2 * r["shard_param_bytes"] == pytest.approx(4 * r["params"], rel=0.01)
        assert r["params"] == rows["pufferfish" if r["factorized"] else "ddp"]["params"]
        assert r["speedup_vs_ddp"] is not None
    full, puff = rows["fsdp"], rows["pufferfish+fsdp"]
    assert puff["bytes_per_step"] < 0.5 * full["bytes_per_step"]
    assert puff["shard_param_bytes"] < 0.5 * full["shard_param_bytes"]
    # The gradients' reduce-scatter carries what DDP's all-reduce carries.
    assert full["reduce_scatter_bytes_per_step"] == rows["ddp"]["bytes_per_step"]
    kinds = {p["method"]: p["kind"] for p in result["projection"]["profiles"]}
    assert kinds["fsdp"] == "sharded" and kinds["ddp"] == "allreduce"


@needs_fashion
def test_results_md_has_the_fsdp2_section(side_by_side: tuple[dict[str, Any], str]) -> None:
    _, md = side_by_side
    assert "## Sharded data parallel (FSDP2)" in md
    section = md.split("## Sharded data parallel (FSDP2)")[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("| pufferfish+fsdp | loopback"))
    assert line.count("x [") == 2  # vs ddp, and vs fsdp within the round


def test_projection_of_fsdp_sends_the_unsharded_bytes_p_minus_1_over_p() -> None:
    rec = {"method": "fsdp", "workers": 2, "bytes_per_step": 4e6, "ring_bytes_per_step": 3e6}
    n = proj.projected_payload(rec)
    assert n == 6e6  # three times a 2 MB model
    prof = proj.CommProfile.for_method("fsdp", 0.0, 0.0, n, collectives=26)
    # c (p-1) α + (p-1)/p 8n/B at p=8: 26*7*50e-6 + 7/8 * 4.8e7 / 1e9
    assert proj.comm_time(prof, 8, 1e9, 50e-6) == pytest.approx(26 * 7 * 50e-6 + 0.042)
    assert proj.projected_payload({**rec, "method": "ddp"}) == 4e6


def test_parallel_fsdp_maps_ddp_and_pufferfish(tmp_path: Path) -> None:
    from pufferfish.bench.flags import add_arguments, config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)

    def methods(*argv: str) -> list[str]:
        return config_from_args(ap.parse_args([*argv, "--out", str(tmp_path)])).methods

    assert methods("--parallel", "fsdp", "--methods", "ddp,pufferfish") == \
        ["fsdp", "pufferfish+fsdp"]
    assert methods("--parallel", "fsdp") == ["fsdp", "pufferfish+fsdp"]  # the default methods
    assert methods("--methods", ALL4) == ALL4.split(",")
    assert acc.phase_methods("pufferfish+fsdp") == ("fsdp", "pufferfish+fsdp")
    assert acc.phase_methods("pufferfish") == ("ddp", "pufferfish")
    cfg = BenchConfig(train=True, methods=["ddp", "fsdp", "pufferfish+fsdp"], epochs=2)
    cfg.validate()
    argv = _train_argv(cfg, "pufferfish+fsdp", tmp_path / "run")
    assert argv[argv.index("--parallel") + 1] == "fsdp"
    assert "--parallel" not in _train_argv(cfg, "ddp", tmp_path / "run")


@pytest.mark.parametrize("args,needle", [
    (["--parallel", "fsdp", "--methods", "ddp,powersgd"],
     "method 'powersgd' is invalid with --parallel fsdp: allowed ddp, pufferfish"),
    (["--methods", "ddp,fsdp", "--compile"], "--compile is invalid with fsdp"),
])
def test_parallel_fsdp_refusals_exit_2_in_one_line(args: list[str], needle: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    assert main(["bench", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_train_refusals_of_fsdp_come_before_any_run(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "recipe.toml"
    toml.write_text('switch_momentum = "project"\n')
    out = tmp_path / "bench"
    assert main(["bench", "--train", "--methods", "ddp,pufferfish", "--parallel", "fsdp",
                 "--epochs", "2", "--train-config", str(toml), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--train fsdp: switch_momentum 'project' is invalid with parallel" in err
    assert not out.exists()


def _fsdp_results(path: Path) -> Path:
    """A results.json of `pufferfish bench --parallel fsdp --rounds 2`, with chosen step times."""
    steps = {"fsdp": (1.0, 1.2), "pufferfish+fsdp": (0.5, 0.6)}
    recs = [{"round": rnd, "bandwidth": "100mbit", "bandwidth_bps": 1e8, "link_bps": 1e8,
             "method": m, "parallel": "fsdp", "workers": 2, "step_time": times[rnd],
             "compute_time": times[rnd] / 2, "comm_time": times[rnd] / 2, "compress_time": 0.0,
             "hook_time": 0.0, "bytes_per_step": 4e6, "ring_bytes_per_step": 3e6,
             "all_gather_bytes_per_step": 2e6, "reduce_scatter_bytes_per_step": 2e6,
             "collectives_per_step": 26.0, "shard_param_bytes": 1e6, "shard_grad_bytes": 1e6,
             "shard_optimizer_bytes": 1e6, "params": 5e5, "factorized": m != "fsdp"}
            for rnd in range(2) for m, times in steps.items()]
    config = {"model": "resnet18", "width": 0.25, "methods": list(steps), "parallel": "fsdp",
              "bandwidths": ["100mbit"], "workers": 2, "batch_size": 64, "rounds": 2,
              "threads": 1}
    path.write_text(json.dumps({
        "config": config, "rounds": recs, "rows": [], "skipped": [], "failures": [],
        "links": [{"bandwidth": "100mbit", "bandwidth_bps": 1e8, "link_bps": 1e8}],
        "order": [[["100mbit", list(steps)]]] * 2}))
    return path


def test_accuracy_runs_under_fsdp_take_fsdp_as_the_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    saved = _fsdp_results(tmp_path / "saved.json")
    full = write_train_run(tmp_path / "full", DDP_ROWS, parallel="fsdp")
    puff = write_train_run(tmp_path / "puff", PUFF_ROWS, mode="pufferfish", warmup_epochs="1",
                      parallel="fsdp")
    out = tmp_path / "out"
    assert main(["bench", "--from-results", str(saved), "--accuracy-runs",
                 f"fsdp={full},pufferfish+fsdp={puff}", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    tta = json.loads((out / "results.json").read_text())["time_to_accuracy"]
    assert tta["target_method"] == "fsdp" and tta["ddp_final_acc"] == 0.90
    by = {(r["method"], r["points_below"]): r for r in tta["measured"]["table"]}
    # 100 steps/epoch; warm-up epoch at fsdp's 1.1 s, then 0.55 s: 110 + 2 * 55 s to -0.5.
    assert by["pufferfish+fsdp", 0.5]["seconds"] == pytest.approx(220)
    assert by["pufferfish+fsdp", 0.5]["speedup_vs_ddp"] == pytest.approx(330 / 220)
    md = (out / "results.md").read_text()
    assert "Targets: FSDP2's final 90.00%" in md and "## Sharded data parallel (FSDP2)" in md
    # A run trained under DDP does not stand for an FSDP2 method.
    ddp_run = write_train_run(tmp_path / "ddp-run", DDP_ROWS)
    assert main(["bench", "--from-results", str(saved), "--accuracy-runs", f"fsdp={ddp_run}",
                 "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the run has parallel 'ddp' but the bench's fsdp measures parallel 'fsdp'" in err
