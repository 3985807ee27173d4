"""``pufferfish bench --methods METHOD:KEY=VALUE``: several settings of one method in one bench.

One real 2-process gloo bench over loopback measures PowerSGD at three ranks (two set per method,
one by the global flag) and Pufferfish at two rank ratios side by side; the rest checks the
parser, precedence over the global flags and the one-line refusals, through the CLI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BENCH_TINY,
    DDP_ROWS,
    PUFF_ROWS,
    bench_record,
    cli_stderr,
    needs_fashion,
    run_cli,
    write_train_run,
)

from pufferfish import factorize
from pufferfish.bench import accuracy as acc
from pufferfish.bench.config import BenchConfig, parallel_methods, parse_compute_ms
from pufferfish.bench.methods import MethodSpec, parse_method_map, setting_keys
from pufferfish.bench.results import project
from pufferfish.bench.rounds import summarize
from pufferfish.bench.runner import _step_argv, _train_argv
from pufferfish.bench.usermodel import factorization_report
from pufferfish.cli import main
from pufferfish.models import build_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bench_my_model.py"

GIVEN = ("ddp,powersgd:rank=1,powersgd,powersgd:rank=04,pufferfish:rank_ratio=0.125,"
         "pufferfish:rank_ratio=.5,diloco:inner_steps=4")
CANONICAL = ["ddp", "powersgd:rank=1", "powersgd", "powersgd:rank=4",
             "pufferfish:rank_ratio=0.125", "pufferfish:rank_ratio=0.5", "diloco:inner_steps=4"]


# -- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "name", "flat"), [
    ("ddp", "ddp", {}),
    ("powersgd:rank=02", "powersgd:rank=2", {"powersgd_rank": 2}),
    ("pufferfish:rank_ratio=.5", "pufferfish:rank_ratio=0.5", {"rank_ratio": 0.5}),
    (" pufferfish+powersgd : rank_ratio=0.25 : rank=2 ", "pufferfish+powersgd:rank_ratio=0.25:rank=2",
     {"rank_ratio": 0.25, "powersgd_rank": 2}),
    ("topk:ratio=5e-2", "topk:ratio=0.05", {"topk_ratio": 0.05}),
    ("diloco:inner_steps=010", "diloco:inner_steps=10", {"inner_steps": 10}),
    ("powersgd:start_iter=3:rank=1", "powersgd:start_iter=3:rank=1",
     {"powersgd_start_iter": 3, "powersgd_rank": 1}),
])
def test_canonical_names(text: str, name: str, flat: dict[str, Any]) -> None:
    spec = MethodSpec.parse(text)
    assert spec.name == name and spec.flat == flat
    assert MethodSpec.parse(spec.name) == spec  # the canonical name parses to itself


def test_keys_come_from_the_hook_registry() -> None:
    assert list(setting_keys("powersgd")) == ["rank", "start_iter"]
    assert list(setting_keys("pufferfish+topk")) == ["ratio", "rank_ratio"]
    assert list(setting_keys("signum")) == ["beta"]
    assert list(setting_keys("pufferfish+diloco")) == ["rank_ratio", "inner_steps"]
    assert list(setting_keys("ddp")) == [] and list(setting_keys("fp16")) == []


def test_a_variant_overrides_the_global_flags_for_itself_only(tmp_path: Path) -> None:
    cfg = BenchConfig(methods=["ddp", "powersgd", "powersgd:rank=01", "pufferfish",
                               "pufferfish:rank_ratio=0.5", "diloco:inner_steps=5"],
                      powersgd_rank=3, rank_ratio=0.125, inner_steps=20, out=str(tmp_path))
    cfg.validate()
    assert cfg.methods[2] == "powersgd:rank=1"  # made canonical
    settings = cfg.method_settings()
    assert settings["powersgd"] == {"powersgd_rank": 3, "powersgd_start_iter": 2}
    assert settings["powersgd:rank=1"] == {"powersgd_rank": 1, "powersgd_start_iter": 2}
    assert settings["pufferfish"] == {"rank_ratio": 0.125}
    assert settings["pufferfish:rank_ratio=0.5"] == {"rank_ratio": 0.5}
    assert settings["diloco:inner_steps=5"] == {"inner_steps": 5}
    assert cfg.powersgd_rank == 3 and cfg.rank_ratio == 0.125  # the global ones untouched

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    step = _step_argv(cfg, cfg.methods, tmp_path / "o.json", tmp_path / "c")
    assert flag(step, "--methods") == ",".join(cfg.methods)
    assert flag(step, "--powersgd-rank") == "3" and flag(step, "--rank-ratio") == "0.125"
    # --train runs each variant with its own settings
    assert flag(_train_argv(cfg, "powersgd:rank=1", tmp_path), "--powersgd-rank") == "1"
    assert flag(_train_argv(cfg, "powersgd", tmp_path), "--powersgd-rank") == "3"
    assert flag(_train_argv(cfg, "pufferfish:rank_ratio=0.5", tmp_path), "--rank-ratio") == "0.5"
    assert flag(_train_argv(cfg, "diloco:inner_steps=5", tmp_path), "--inner-steps") == "5"


def test_map_flags_take_variants_key_before_the_last_equals() -> None:
    assert parse_compute_ms("full=9.5,powersgd:rank=02=38,pufferfish:rank_ratio=.5=7") == {
        "full": 9.5, "powersgd:rank=2": 38.0, "pufferfish:rank_ratio=0.5": 7.0}
    found = parse_method_map("ddp=a,powersgd:rank=2=runs/p", "--accuracy-runs", "M=D", None, "")
    assert found == {"ddp": "a", "powersgd:rank=2": "runs/p"}
    with pytest.raises(ValueError, match="names method 'powersgd:rank=2' twice"):
        parse_method_map("powersgd:rank=2=a,powersgd:rank=02=b", "--x", "M=D", None, "")
    with pytest.raises(ValueError, match="--compute-ms 'full=1,powersgd:rank=0=3' is invalid"):
        parse_compute_ms("full=1,powersgd:rank=0=3")
    # a factorized variant warms up as the full-rank method with the same hook settings
    assert acc.phase_methods("pufferfish+powersgd:rank_ratio=0.5:rank=2") == (
        "powersgd:rank=2", "pufferfish+powersgd:rank_ratio=0.5:rank=2")
    assert acc.phase_methods("pufferfish:rank_ratio=0.5") == ("ddp", "pufferfish:rank_ratio=0.5")


def test_accuracy_runs_are_checked_against_the_variants_settings(tmp_path: Path) -> None:
    ddp = write_train_run(tmp_path / "full", DDP_ROWS)
    puff = write_train_run(tmp_path / "puff", PUFF_ROWS, mode="pufferfish", warmup_epochs="1",
                           rank_ratio="0.5")
    common = {"model": "resnet18", "width": 0.25, "batch_size": 64, "powersgd_rank": 4}
    runs = acc.load_accuracy_runs(f"ddp={ddp},pufferfish:rank_ratio=.5={puff}", **common)
    assert list(runs) == ["ddp", "pufferfish:rank_ratio=0.5"]
    with pytest.raises(ValueError, match=re.escape(
            "the run has rank_ratio '0.5' but the bench's pufferfish:rank_ratio=0.125 measures "
            "rank_ratio")):
        acc.load_accuracy_runs(f"ddp={ddp},pufferfish:rank_ratio=0.125={puff}", **common)


def test_parallel_fsdp_keeps_a_variants_settings() -> None:
    assert parallel_methods(["ddp", "pufferfish:rank_ratio=0.5"], "fsdp") == [
        "fsdp", "pufferfish+fsdp:rank_ratio=0.5"]


def test_the_projection_pools_compute_per_model_not_across_rank_ratios(tmp_path: Path) -> None:
    # Compute-only steps of one model are pooled over its methods; two rank ratios are two models.
    methods = ["ddp", "pufferfish", "pufferfish+fp16", "pufferfish:rank_ratio=0.5"]
    recs = [bench_record(m, "100mbit", 1e8, step, compute, 0.0, nbytes)
            for m, step, compute, nbytes in (("ddp", 1.0, 0.4, 10e6),
                                             ("pufferfish", 0.3, 0.1, 2e6),
                                             ("pufferfish+fp16", 0.3, 0.2, 1e6),
                                             ("pufferfish:rank_ratio=0.5", 0.6, 0.3, 5e6))]
    cfg = BenchConfig(out=str(tmp_path), methods=methods, rounds=1)
    ms = project(summarize(recs, ["100mbit"], methods), cfg)["compute_ms"]
    assert ms["pufferfish"] == pytest.approx(150.0) == ms["pufferfish+fp16"]  # median of 0.1, 0.2
    assert ms["pufferfish:rank_ratio=0.5"] == pytest.approx(300.0)


@pytest.mark.parametrize(("methods", "needle"), [
    ("ddp,gossip:rank=1", "unknown method 'gossip' in --methods entry 'gossip:rank=1': allowed "
                          "ddp, fp16, powersgd"),
    ("ddp,powersgd:rnk=2", "--methods entry 'powersgd:rnk=2': key 'rnk' is invalid for "
                           "powersgd: allowed rank, start_iter"),
    ("ddp,pufferfish:rank=2", "key 'rank' is invalid for pufferfish: allowed rank_ratio"),
    ("ddp:rank=1", "key 'rank' is invalid for ddp: allowed none"),
    ("ddp,powersgd:rank=0", "--methods entry 'powersgd:rank=0': rank '0' is invalid: allowed an "
                            "integer >= 1"),
    ("ddp,pufferfish:rank_ratio=1.5", "rank_ratio '1.5' is invalid: allowed a number in (0, 1]"),
    ("ddp,powersgd:rank", "--methods entry 'powersgd:rank' is invalid: allowed METHOD or "
                          "METHOD:KEY=VALUE"),
    ("ddp,powersgd:rank=2,powersgd:rank=02",
     "names method 'powersgd:rank=2' twice (powersgd:rank=2 and powersgd:rank=02): allowed each "
     "method (with its settings) once"),
    ("ddp,powersgd:start_iter=5", "warmup 3 is invalid: allowed >= powersgd_start_iter (5)"),
])
def test_bad_entries_exit_2_in_one_line(methods: str, needle: str, tmp_path: Path,
                                        capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    # in this process (a real one's exit: tests/test_reliability.py's one-line checks)
    code, lines = cli_stderr(["bench", "--methods", methods, "--out", str(out)], capfd)
    assert code == 2 and len(lines) == 1, lines
    err = lines[0]
    assert err.startswith("pufferfish: error:") and needle in err, err
    assert not out.exists()  # refused before any worker started


# -- one real bench ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-variants")
    rc = main(["bench", *BENCH_TINY, "--methods", GIVEN, "--powersgd-rank", "2",
               "--bucket-mb", "torch", "--bandwidth", "loopback", "--rounds", "1",
               "--out", str(out)])
    assert rc == 0
    return {**json.loads((out / "results.json").read_text()), "out": out}


def _params_at(ratio: float) -> int:
    model = build_model("resnet18", num_classes=10, in_channels=1, width=0.125, image_size=28)
    factorize(model, rank_ratio=ratio, preset="paper")
    return sum(p.numel() for p in model.parameters())


@needs_fashion
def test_each_variant_is_a_row_measured_with_its_settings(variants: dict[str, Any]) -> None:
    rows = {r["method"]: r for r in variants["rows"]}
    assert list(rows) == CANONICAL
    # PowerSGD's payload per step grows with its rank: 1 (own) < 2 (the global flag) < 4 (own)
    sent = [rows[m]["bytes_per_step"] for m in ("powersgd:rank=1", "powersgd", "powersgd:rank=4")]
    assert 0 < sent[0] < sent[1] < sent[2] < rows["ddp"]["bytes_per_step"]
    small, large = rows["pufferfish:rank_ratio=0.125"], rows["pufferfish:rank_ratio=0.5"]
    assert small["params"] == _params_at(0.125) and large["params"] == _params_at(0.5)
    assert small["params"] < large["params"] < rows["ddp"]["params"]
    # DiLoCo's outer step every 4 steps (the global --inner-steps is 50): a quarter of DDP's bytes
    diloco = rows["diloco:inner_steps=4"]
    assert [r["inner_steps"] for r in variants["rounds"] if r["method"] == diloco["method"]] == [4]
    assert diloco["bytes_per_step"] == pytest.approx(rows["ddp"]["bytes_per_step"] / 4, rel=0.05)
    assert variants["config"]["method_settings"]["powersgd"]["powersgd_rank"] == 2
    assert variants["config"]["method_settings"]["powersgd:rank=1"]["powersgd_rank"] == 1
    assert variants["config"]["method_settings"]["pufferfish:rank_ratio=0.125"] == {
        "rank_ratio": 0.125}


@needs_fashion
def test_results_md_and_the_projection_name_each_variant(variants: dict[str, Any]) -> None:
    md = (variants["out"] / "results.md").read_text()
    for name in CANONICAL:
        assert f"| loopback | {name} |" in md or f"| {name} | loopback |" in md, name
    assert "Measured with their own settings" in md
    # the compute figures results.md offers to reuse parse back, one per variant
    flag = md.split("as measured here: ")[1].split("`--compute-ms ")[1].split("`")[0]
    assert set(parse_compute_ms(flag)) == set(CANONICAL)
    assert set(variants["projection"]["crossovers"]) >= set(CANONICAL) - {"ddp"}


@needs_fashion
def test_from_results_projects_a_variant_with_its_own_compute(variants: dict[str, Any],
                                                               tmp_path: Path) -> None:
    out = tmp_path / "again"
    assert main(["bench", "--from-results", str(variants["out"]), "--compute-ms",
                 "full=10,factorized=4,powersgd:rank=1=30", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in again["rows"]] == CANONICAL
    sources = again["projection"]["compute_sources"]
    assert sources["powersgd:rank=1"] == "given" and sources["powersgd:rank=4"] != "given"


def test_variants_of_your_model_under_torchrun(tmp_path: Path) -> None:
    """torchrun's processes measure each variant (bench/launched.py); the Workload's own
    rank_ratio (1/4) is the default that a variant's rank_ratio overrides."""
    out = tmp_path / "bench"
    ref = f"{EXAMPLE}:make"
    methods = ["ddp", "pufferfish", "pufferfish:rank_ratio=0.5", "powersgd:rank=1", "powersgd"]
    run = run_cli("bench", "--model", ref, "--methods", ",".join(methods), "--rounds", "1",
                  "--steps", "3", "--warmup", "2", "--compute-steps", "2", "--batch-size", "16",
                  "--threads", "1", "--bucket-mb", "torch", "--out", str(out), torchrun=2,
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "at rank ratio 0.5" in run.stdout  # the variant's factorization, reported
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == methods
    assert rows["pufferfish"]["params"] == factorization_report(ref).params_after
    assert rows["pufferfish:rank_ratio=0.5"]["params"] == \
        factorization_report(ref, rank_ratio=0.5).params_after > rows["pufferfish"]["params"]
    assert rows["powersgd:rank=1"]["bytes_per_step"] < rows["powersgd"]["bytes_per_step"]


def test_train_runs_compress_from_a_start_past_the_timing_warm_up(tmp_path: Path) -> None:
    """`make demo`'s PowerSGD starts at 10% of its steps (94): --train times no step, so the
    timing warm-up (3) does not bound it; its runs are trained with it."""
    kw = dict(methods=["ddp", "powersgd", "pufferfish+powersgd"], powersgd_start_iter=94,
              out=str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"warmup 3 is invalid: allowed >= powersgd_start_iter"):
        BenchConfig(**kw).validate()
    cfg = BenchConfig(**kw, train=True)
    cfg.validate()
    argv = _train_argv(cfg, "powersgd", tmp_path)
    assert argv[argv.index("--powersgd-start-iter") + 1] == "94"
