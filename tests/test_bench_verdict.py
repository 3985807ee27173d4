"""The bench's verdict (the table results.md opens with, the sentence of what would change it),
per-method ``--compute-ms`` in the projection, and the device / precision / timing choices of the
step workers: constructed cases whose answers are known analytically, and the CPU path for real
(the real tiny bench run whose results.md opens with the table is in tests/test_bench.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bench_record

from pufferfish.bench import projection as proj
from pufferfish.bench.markdown import results_markdown
from pufferfish.bench.progress import measuring
from pufferfish.bench.results import project
from pufferfish.bench.rounds import compute_check, summarize
from pufferfish.bench.runner import BenchConfig
from pufferfish.bench.step import amp_for
from pufferfish.bench.verdict import catch_up, verdict
from pufferfish.cli import main
from pufferfish.distributed.env import pick_device
from pufferfish.training.step import timed


def _record(method: str, bw: str, rate: float | None, compute: float, compress: float,
            wire_s: float, extra: float = 0.0, calls: float = 1.0) -> dict[str, Any]:
    """A 2-worker record whose step is compute + compress + ``wire_s`` seconds on the wire at
    ``rate`` (+ ``extra``): with 2 workers an all-reduce puts 8 x its payload bits on the wire."""
    nbytes = wire_s * (rate or 1e8) / 8
    step = compute + compress + wire_s + extra
    return bench_record(method, bw, rate, step, compute, compress, nbytes, calls)


def _result(records: list[dict[str, Any]], links: list[str], methods: list[str],
            tmp_path: Path, **cfg: Any) -> tuple[BenchConfig, dict[str, Any]]:
    rows = summarize(records, links, methods)
    config = BenchConfig(out=str(tmp_path), methods=methods, rounds=1, **cfg)
    projection = project(rows, config)
    return config, {
        "rows": rows, "rounds": records, "projection": projection,
        "links": [{"bandwidth": b, "bandwidth_bps": r["bandwidth_bps"],
                   "link_bps": r["link_bps"]}
                  for b in links for r in records[:1] if True],
        "order": [[(b, methods) for b in links]], "compute_check": compute_check(rows),
        "time_to_accuracy": None, "skipped": [], "failures": []}


# 100 Mbit/s: PowerSGD wins (0.29 s); DDP's line 0.2 + 0.81/s meets PowerSGD's 0.28 + 0.01/s at
# s = 0.8 / 0.08 = 10x the bandwidth; Pufferfish's 0.3 + 0.2/s never meets it (0.02 + 0.19/s > 0).
SLOW = [_record("ddp", "100mbit", 1e8, 0.2, 0.0, 0.81),
        _record("powersgd", "100mbit", 1e8, 0.2, 0.05, 0.01, extra=0.03, calls=3),
        _record("pufferfish", "100mbit", 1e8, 0.1, 0.0, 0.2, extra=0.2)]
# 1 Gbit/s: Pufferfish's 0.1 + 0.02/s is below DDP's 0.2 + 0.081/s at every s > 0.
FAST = [_record("ddp", "1gbit", 1e9, 0.2, 0.0, 0.081),
        _record("pufferfish", "1gbit", 1e9, 0.1, 0.0, 0.02)]


def test_catch_up_is_the_analytic_crossing() -> None:
    # T = max(floor, a + b x), x = 1 / bandwidth factor.
    assert catch_up((0.28, 0.01, 0.25), (0.2, 0.81, 0.2)) == [pytest.approx(0.1)]
    assert catch_up((0.1, 0.02, 0.1), (0.2, 0.081, 0.2)) == []
    # A floor: the winner's line 0.45 + 0.05 x drops below its 0.5 s of compute for x < 1, so
    # the other's 0.3 + 0.3 x meets it at x = 2/3 (1.5x the bandwidth), not at the lines' 0.6.
    assert catch_up((0.45, 0.05, 0.5), (0.3, 0.3, 0.3)) == [pytest.approx(2 / 3)]


def test_verdict_table_and_sentences_on_a_constructed_case(tmp_path: Path) -> None:
    cfg, result = _result(SLOW + FAST, ["100mbit", "1gbit"], ["ddp", "powersgd", "pufferfish"],
                          tmp_path)
    v = result["projection"]["verdict"]
    assert [(x["link"], x["winner"]) for x in v["links"]] == [("100mbit", "powersgd"),
                                                               ("1gbit", "pufferfish")]
    assert v["links"][0]["changes"] == [{"method": "ddp", "factor": pytest.approx(10.0),
                                         "bps": pytest.approx(1e9)}]
    md = results_markdown(cfg, result, plots=[])
    lines = md.splitlines()
    assert lines[2] == ("| link | method | step ms | compute ms | exposed comm ms | "
                        "encode/decode ms | MB/step | speed-up vs ddp | fastest on this link |")
    assert ("| 100mbit | powersgd | 290.0 | 200.0 | 90.0 | 50.0 | 0.125 | 3.48x | **fastest** |"
            in lines)
    assert "| 100mbit | ddp | 1010.0 | 200.0 | 810.0 | 0.0 | 10.125 | 1.00x |  |" in lines
    assert ("100mbit: powersgd is fastest; at 10x the bandwidth (1.0 Gbit/s) ddp catches up "
            "(α-β model).") in lines
    assert ("1gbit: pufferfish is fastest, and no bandwidth between 0.1x and 100x the link's "
            "1.0 Gbit/s changes the winner (α-β model).") in lines


def test_verdict_without_a_link_rate_says_it_cannot_project() -> None:
    rows = summarize([_record("ddp", "loopback", None, 0.2, 0.0, 0.01),
                      _record("pufferfish", "loopback", None, 0.1, 0.0, 0.01)],
                     ["loopback"], ["ddp", "pufferfish"])
    for r in rows:
        r["model_bps"] = None
    (link,) = verdict(rows)["links"]
    assert link["sentence"].startswith("loopback: pufferfish is fastest; the link has no "
                                       "measured rate")
    assert verdict(rows[:1])["links"][0]["sentence"] == "loopback: ddp is the only method measured."


# -- --compute-ms per method ----------------------------------------------------------------------


PROFILES = [proj.CommProfile.for_method("ddp", 0.2, 0.0, 1e7),
            proj.CommProfile.for_method("powersgd", 0.2, 0.05, 1e5, 3),
            proj.CommProfile.for_method("pufferfish", 0.1, 0.0, 2.5e6)]


def test_with_compute_sources_and_the_cpu_ratio_fallback() -> None:
    only_full = proj.with_compute(PROFILES, {"full": 20.0})
    assert only_full.sources == {"ddp": "model", "powersgd": "model", "pufferfish": "cpu ratio"}
    assert only_full.assumes_cpu_ratio and only_full.scale == pytest.approx(0.1)
    got = {p.method: (p.compute_time, p.compress_time) for p in only_full.profiles}
    assert got == {"ddp": pytest.approx((0.02, 0.0)), "powersgd": pytest.approx((0.02, 0.005)),
                   "pufferfish": pytest.approx((0.01, 0.0))}  # this CPU's 1/2 kept
    each = proj.with_compute(PROFILES, {"full": 9.5, "factorized": 13.7, "powersgd": 38.0})
    assert each.sources == {"ddp": "model", "powersgd": "given", "pufferfish": "model"}
    assert not each.assumes_cpu_ratio
    got = {p.method: (p.compute_time, p.compress_time) for p in each.profiles}
    assert got == {"ddp": pytest.approx((0.0095, 0.0)), "powersgd": pytest.approx((0.038, 0.0)),
                   "pufferfish": pytest.approx((0.0137, 0.0))}
    measured = proj.with_compute(PROFILES, None)
    assert measured.profiles == PROFILES and set(measured.sources.values()) == {"measured"}


def test_projection_uses_the_figures_and_says_where_it_fell_back(tmp_path: Path) -> None:
    # The H200 figures of docs/benchmarks.md: the factorized step slower than full rank's.
    cfg, result = _result(SLOW, ["100mbit"], ["ddp", "powersgd", "pufferfish"], tmp_path,
                          compute_ms="full=9.5,factorized=13.7,powersgd=38")
    pj = result["projection"]
    assert pj["compute_ms"] == pytest.approx({"ddp": 9.5, "powersgd": 38.0, "pufferfish": 13.7})
    row = next(r for r in pj["rows"] if r["method"] == "pufferfish" and r["workers"] == 8
               and r["bandwidth_bps"] == 100e9 and r["alpha"] == cfg.alpha)
    prof = proj.CommProfile.for_method("pufferfish", 0.0137, 0.0, SLOW[2]["bytes_per_step"])
    assert row["step_time"] == pytest.approx(proj.step_time(prof, 8, 100e9, cfg.alpha))
    assert "FALLS BACK" not in results_markdown(cfg, result, plots=[])
    cfg, result = _result(SLOW, ["100mbit"], ["ddp", "powersgd", "pufferfish"], tmp_path,
                          compute_ms="9.5")
    md = results_markdown(cfg, result, plots=[])
    assert "FALLS BACK to this machine's low-rank/full ratio (0.50) for pufferfish" in md


def test_results_md_names_the_device_and_on_a_gpu_what_compress_leaves_out(
        tmp_path: Path) -> None:
    gpu = [{**r, "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"} for r in SLOW]
    md = results_markdown(*_result(gpu, ["100mbit"], ["ddp", "powersgd", "pufferfish"],
                                   tmp_path), plots=[])
    assert "Measured on: cuda (NVIDIA H100 80GB HBM3)." in md
    assert "compress is the host's time around the hooks' encode/decode" in md
    cpu = [{**r, "device": "cpu", "device_name": ""} for r in SLOW]
    md = results_markdown(*_result(cpu, ["100mbit"], ["ddp", "powersgd", "pufferfish"],
                                   tmp_path), plots=[])
    assert "Measured on: cpu." in md and "host's time around" not in md


def test_a_cpu_record_names_its_cpu() -> None:
    """CPUs differ several-fold in compute, which decides whether a step waits on the wire: a
    record says which one it ran on, as a GPU record says which GPU."""
    from pufferfish.bench.step import cpu_name, device_facts

    assert device_facts(torch.device("cpu")) == {"device": "cpu", "device_name": cpu_name()}
    info = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in
              (info.read_text().splitlines() if info.is_file() else [])
              if line.startswith("model name")]
    if models:  # Linux on x86 (ARM's cpuinfo has no model name: the platform's word then)
        assert cpu_name() == models[0] != ""


# -- the step workers: device, precision, timing, progress ----------------------------------------


def test_pick_device() -> None:
    cpu = torch.device("cpu")
    assert pick_device("auto", 1, cuda_count=0) == cpu
    assert pick_device("cpu", 1, cuda_count=8) == cpu
    assert pick_device("auto", 1, cuda_count=2) == torch.device("cuda", 1)
    # Two local ranks that see one GPU: the same index (shared, or each bound to its own by the
    # scheduler: the job's backend tells them apart, tests/test_job_backend.py).
    assert pick_device("auto", 1, cuda_count=1) == torch.device("cuda", 0)
    assert pick_device("auto", 3, cuda_count=2) == torch.device("cuda", 1)
    assert pick_device("auto", 3, cuda_count=8) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="--device 'cuda' is invalid here"):
        pick_device("cuda", 0, cuda_count=0)
    with pytest.raises(ValueError, match="--device 'tpu' is invalid: allowed auto, cpu, cuda"):
        pick_device("tpu", 0, cuda_count=0)
    # This machine's own choice, as the workers make it:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto", 0, torch.cuda.device_count()).type == want


def test_amp_for_builds_autocast_and_the_scaler_without_running_kernels() -> None:
    cpu = torch.device("cpu")
    assert amp_for("none", cpu) == (None, None)
    autocast, scaler = amp_for("bf16", cpu)
    assert autocast.fast_dtype == torch.bfloat16 and autocast.device == "cpu" and scaler is None
    autocast, scaler = amp_for("fp16", cpu)
    assert autocast.fast_dtype == torch.float16 and isinstance(scaler, torch.amp.GradScaler)


def test_timed_runs_the_step_once_on_the_cpu_path() -> None:
    calls: list[int] = []
    seconds = timed(lambda: calls.append(1), torch.device("cpu"))
    assert calls == [1] and seconds >= 0.0
    assert timed(lambda: calls.append(2)) >= 0.0 and calls == [1, 2]


def test_measuring_bar_counts_the_groups() -> None:
    out = io.StringIO()
    with measuring(3, file=out) as bar:
        for _ in range(3):
            bar.update(1)
    assert bar.n == 3 and "measuring:" in out.getvalue() and "0/3" in out.getvalue()


def test_a_step_measured_below_its_compute_stays_the_winner_at_its_own_link(
        tmp_path: Path) -> None:
    # DDP's step (0.25 s) came out below its compute-only step (0.3 s): noise. Its line is floored
    # at the measured step, so at 1x it still wins; only with less bandwidth does Pufferfish's
    # 0.25 + 0.01 x meet DDP's 0.2 + 0.05 x, at x = 1.25, i.e. 0.8x the bandwidth.
    records = [_record("ddp", "1gbit", 1e9, 0.3, 0.0, 0.05, extra=-0.1),
               _record("pufferfish", "1gbit", 1e9, 0.2, 0.0, 0.01, extra=0.05)]
    _, result = _result(records, ["1gbit"], ["ddp", "pufferfish"], tmp_path)
    (link,) = result["projection"]["verdict"]["links"]
    assert link["sentence"] == ("1gbit: ddp is fastest; at 0.8x the bandwidth (800.0 Mbit/s) "
                                "pufferfish catches up (α-β model).")


def test_compute_ms_alone_projects_saved_results_and_says_it_falls_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --compute-ms no longer needs --accuracy-runs: the cluster projection uses it.
    saved = tmp_path / "saved.json"
    methods = ["ddp", "powersgd", "pufferfish"]
    saved.write_text(json.dumps({
        "config": {"model": "resnet18", "width": 0.5, "methods": methods,
                   "bandwidths": ["100mbit"], "workers": 2, "rounds": 1},
        "rounds": SLOW, "links": [{"bandwidth": "100mbit", "bandwidth_bps": 1e8,
                                   "delay_ms": 0.0, "link_bps": 1e8, "link_rtt_s": None}],
        "order": [[["100mbit", methods]]], "skipped": [], "failures": [], "rows": []}))
    out = tmp_path / "out"
    assert main(["bench", "--from-results", str(saved), "--compute-ms", "9.5",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "note: --compute-ms gave no factorized=MS, so the projection assume" in said
    md = (out / "results.md").read_text().splitlines()
    assert md[2].startswith("| link | method | step ms |")
    assert "100mbit: powersgd is fastest; at 10x the bandwidth (1.0 Gbit/s) ddp catches up " \
           "(α-β model)." in md
    assert any("FALLS BACK to this machine's low-rank/full ratio (0.50) for pufferfish" in line
               for line in md)
    pj = json.loads((out / "projection.json").read_text())
    assert pj["compute_sources"] == {"ddp": "model", "powersgd": "model",
                                     "pufferfish": "cpu ratio"}
