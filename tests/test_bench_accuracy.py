"""``pufferfish bench``: interleaved rounds and time to accuracy, on hand-computed numbers.

No processes start here: the arithmetic is checked on synthetic per-round records and
synthetic ``pufferfish train`` run directories (real config.toml / metrics.jsonl files
written by the library's own writers), and the CLI path through ``--from-results``.
The real worker runs are in ``tests/test_bench.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import DDP_ROWS, PUFF_ROWS, accuracy_runs, write_train_run

from pufferfish.bench import accuracy as acc
from pufferfish.bench import projection as proj
from pufferfish.bench.rounds import compute_check, round_plan, summarize
from pufferfish.cli import main

LINKS = ["loopback", "1gbit", "100mbit"]
METHODS3 = ["ddp", "powersgd", "pufferfish"]


# -- the interleaving order ------------------------------------------------------------------------


def test_every_method_in_every_round_and_the_order_rotates() -> None:
    plan = round_plan(LINKS, METHODS3, 3)
    assert len(plan) == 3
    for rnd in plan:
        assert sorted(link for link, _ in rnd) == sorted(LINKS)
        assert all(sorted(ms) == sorted(METHODS3) for _, ms in rnd)
    # Each method goes first (and last) in exactly one round; so does each link.
    assert sorted(rnd[0][1][0] for rnd in plan) == sorted(METHODS3)
    assert sorted(rnd[0][1][-1] for rnd in plan) == sorted(METHODS3)
    assert sorted(rnd[0][0] for rnd in plan) == sorted(LINKS)
    assert plan[0] == [(link, METHODS3) for link in LINKS]
    assert plan[1][0] == ("1gbit", ["powersgd", "pufferfish", "ddp"])
    with pytest.raises(ValueError, match="rounds 0 is invalid"):
        round_plan(LINKS, METHODS3, 0)


# -- median, spread and per-round ratios -------------------------------------------------------------


def _rec(rnd: int, link: str, method: str, step: float, compute: float) -> dict[str, Any]:
    return {"round": rnd, "bandwidth": link, "method": method, "step_time": step,
            "compute_time": compute, "comm_time": -1.0, "compress_time": 0.01 * (rnd + 1),
            "bytes_per_step": 1e6, "per_rank": [{}]}


def test_median_spread_and_ratio_within_rounds() -> None:
    steps = {"ddp": [1.0, 2.0, 1.1], "pufferfish": [0.5, 0.8, 1.0]}
    computes = {"ddp": [0.8, 1.0, 1.0], "pufferfish": [0.4, 0.5, 0.6]}
    recs = [_rec(r, "100mbit", m, steps[m][r], computes[m][r])
            for r in range(3) for m in ("pufferfish", "ddp")]
    ddp, puff = summarize(recs, ["100mbit"], ["ddp", "pufferfish"])
    assert (ddp["method"], ddp["rounds"]) == ("ddp", 3) and "per_rank" not in ddp
    assert ddp["step_time"] == 1.1 and ddp["spread"]["step_time"] == [1.0, 2.0]
    # comm per round = step - compute: 0.2, 1.0, 0.1 -> median 0.2 (not 1.1 - 1.0)
    assert ddp["comm_time"] == pytest.approx(0.2)
    assert ddp["spread"]["comm_time"] == pytest.approx([0.1, 1.0])
    assert ddp["comm_share"] == pytest.approx(0.2)  # 0.2/1.0, 1.0/2.0, 0.1/1.1
    assert ddp["compress_time"] == pytest.approx(0.02)
    # Ratios per round: 2.0, 2.5, 1.1 -> median 2.0 (the ratio of medians would be 1.375).
    assert puff["speedup_vs_ddp"] == pytest.approx(2.0)
    assert puff["spread"]["speedup_vs_ddp"] == pytest.approx([1.1, 2.5])
    assert ddp["speedup_vs_ddp"] == 1.0
    # A link without DDP has no ratio; a method never measured has no row.
    [alone] = summarize([_rec(0, "1gbit", "pufferfish", 0.5, 0.4)], ["1gbit"], METHODS3)
    assert alone["speedup_vs_ddp"] is None


def test_compute_check_flags_a_link_dependent_compute() -> None:
    rows = [{"method": "ddp", "bandwidth": "loopback", "compute_time": 1.0},
            {"method": "ddp", "bandwidth": "100mbit", "compute_time": 1.2},
            {"method": "pufferfish", "bandwidth": "loopback", "compute_time": 0.5},
            {"method": "pufferfish", "bandwidth": "100mbit", "compute_time": 0.55}]
    ddp, puff = compute_check(rows)
    assert ddp["disagreement"] == pytest.approx(0.2) and ddp["flagged"]
    assert puff["disagreement"] == pytest.approx(0.1) and not puff["flagged"]
    assert puff["compute_time"] == {"loopback": 0.5, "100mbit": 0.55}


# -- time to accuracy ----------------------------------------------------------------------------


def test_wallclock_and_time_to_accuracy_known_numbers() -> None:
    assert acc.steps_per_epoch(12_800, 64, 2) == 100
    assert acc.steps_per_epoch(60_000, 64, 2) == 468  # the loader drops the last partial batch
    assert acc.phase_methods("pufferfish") == ("ddp", "pufferfish")
    assert acc.phase_methods("pufferfish+powersgd") == ("powersgd", "pufferfish+powersgd")
    assert acc.phase_methods("powersgd") == ("powersgd", "powersgd")
    # Pufferfish: 100 steps at DDP's 1.0 s (warm-up), then 100 at 0.5 s per epoch.
    times = acc.wallclock(PUFF_ROWS, 100, 1.0, 0.5)
    assert times == [100.0, 150.0, 200.0]
    assert acc.time_to_accuracy(PUFF_ROWS, 0.89, times) == 150.0
    assert acc.time_to_accuracy(PUFF_ROWS, 0.95, times) is None
    # Without times: the run's own clock (cumulative epoch_time).
    assert acc.time_to_accuracy([{"epoch_time": 3.0, "test_acc": 0.1},
                                 {"epoch_time": 4.0, "test_acc": 0.7}], 0.5) == 7.0


def test_measured_curves_targets_and_speedup_bounds() -> None:
    steps = {("100mbit", "ddp"): acc.StepTime(1.0, 0.9, 1.2),
             ("100mbit", "pufferfish"): acc.StepTime(0.5, 0.4, 0.6)}
    curves = acc.measured_curves(accuracy_runs(), steps, ["100mbit", "1gbit"], workers=2)
    assert [(c.regime, c.method) for c in curves] == [("100mbit", "ddp"), ("100mbit", "pufferfish")]
    ddp, puff = curves
    assert ddp.times == [100.0, 200.0, 300.0] and ddp.low == pytest.approx([90, 180, 270])
    assert puff.low == pytest.approx([90, 130, 170]) and puff.high == pytest.approx([120, 180, 240])
    table = acc.target_table(curves, ddp_final=0.90)
    by = {(r["method"], r["points_below"]): r for r in table}
    # -0.5 point (0.895): DDP at epoch 3 (300 s), Pufferfish at epoch 3 (200 s).
    half = by["pufferfish", 0.5]
    assert (half["epoch"], half["seconds"]) == (3, 200.0)
    assert half["speedup_vs_ddp"] == pytest.approx(1.5)
    assert half["speedup_worst"] == pytest.approx(270 / 240)  # DDP fast, Pufferfish slow
    assert half["speedup_best"] == pytest.approx(360 / 170)
    # -1 point (0.89): Pufferfish already at epoch 2 (150 s), DDP still at epoch 3.
    one = by["pufferfish", 1.0]
    assert (one["epoch"], one["seconds"], one["speedup_vs_ddp"]) == (2, 150.0, 2.0)
    assert by["ddp", 1.0]["seconds"] == 300.0 and by["ddp", 1.0]["speedup_vs_ddp"] == 1.0
    never = acc.target_table(curves, ddp_final=0.95, points=(0.5,))
    assert all(r["seconds"] is None and r["speedup_vs_ddp"] is None for r in never)


def test_projection_scales_compute_to_the_given_gpu_time() -> None:
    profiles = [proj.CommProfile.for_method("ddp", 0.2, 0.0, 1e6),
                proj.CommProfile.for_method("pufferfish", 0.1, 0.0, 0.25e6)]
    curves, info = acc.projected_curves(accuracy_runs(), profiles, compute_ms=10.0, workers=(8,),
                                        bandwidths=(1e9,), alpha=0.0)
    assert info["scale"] == pytest.approx(0.05) and info["lowrank_compute_ratio"] == 0.5
    ddp, puff = curves
    assert ddp.regime == "p=8, 1.0 Gbit/s" and ddp.steps_per_epoch == 25  # 12800 // 8 // 64
    # DDP: 10 ms compute + 2*7/8 * 8e6 bit / 1 Gbit/s = 24 ms; Pufferfish: 5 ms + 3.5 ms.
    assert ddp.step_times["full"] == pytest.approx(0.024)
    assert puff.step_times == pytest.approx({"full": 0.024, "lowrank": 0.0085})
    assert ddp.times == pytest.approx([0.6, 1.2, 1.8])
    assert puff.times == pytest.approx([0.6, 0.8125, 1.025]) and puff.low == puff.times
    by = {(r["method"], r["points_below"]): r for r in acc.target_table(curves, 0.90)}
    assert by["pufferfish", 0.5]["speedup_vs_ddp"] == pytest.approx(1.8 / 1.025)


# -- the CLI path: --from-results + --accuracy-runs + --compute-ms ---------------------------------


def _bench_results(path: Path) -> Path:
    """A results.json as `pufferfish bench --rounds 2` writes it, with chosen step times."""
    steps = {"loopback": {"ddp": (0.5, 0.6), "pufferfish": (0.25, 0.35)},
             "100mbit": {"ddp": (1.0, 1.2), "pufferfish": (0.5, 0.6)}}
    rate = {"loopback": None, "100mbit": 100_000_000}
    recs = []
    for rnd in range(2):
        for link, by_method in steps.items():
            for method, per_round in by_method.items():
                step = per_round[rnd]
                recs.append({"round": rnd, "bandwidth": link, "bandwidth_bps": rate[link],
                             "link_bps": rate[link], "method": method, "workers": 2,
                             "step_time": step, "compute_time": step / 2, "comm_time": step / 2,
                             "compress_time": 0.0, "hook_time": 0.0,
                             "bytes_per_step": 2.8e6 if method == "ddp" else 0.86e6,
                             "ring_bytes_per_step": 2.8e6, "collectives_per_step": 1.0,
                             "params": 7e5, "factorized": method == "pufferfish"})
    config = {"model": "resnet18", "width": 0.25, "methods": ["ddp", "pufferfish"],
              "bandwidths": ["loopback", "100mbit"], "workers": 2, "batch_size": 64,
              "rounds": 2, "threads": 1}
    path.write_text(json.dumps({
        "config": config, "rounds": recs, "rows": [], "skipped": [], "failures": [],
        "links": [{"bandwidth": b, "bandwidth_bps": rate[b], "link_bps": rate[b]} for b in steps],
        "order": [[[b, ["ddp", "pufferfish"]] for b in steps]] * 2}))
    return path


def test_time_to_accuracy_from_saved_step_times(tmp_path: Path) -> None:
    ddp = write_train_run(tmp_path / "full", DDP_ROWS)
    puff = write_train_run(tmp_path / "puff", PUFF_ROWS, mode="pufferfish", warmup_epochs="1")
    saved = _bench_results(tmp_path / "saved.json")
    out = tmp_path / "out"
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs",
               f"ddp={ddp},pufferfish={puff}", "--compute-ms", "10", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["batch_size"] == 64 and len(result["rounds"]) == 8
    tta = result["time_to_accuracy"]
    assert tta["ddp_final_acc"] == 0.90 and tta["runs"]["pufferfish"]["epochs"] == 3
    by = {(r["regime"], r["method"], r["points_below"]): r for r in tta["measured"]["table"]}
    # 100mbit: DDP 1.1 s/step median (1.0-1.2), Pufferfish 0.55 (0.5-0.6); 100 steps/epoch.
    puff_half = by["100mbit", "pufferfish", 0.5]
    assert puff_half["seconds"] == pytest.approx(110 + 2 * 55)
    assert puff_half["speedup_vs_ddp"] == pytest.approx(330 / 220)
    assert puff_half["speedup_worst"] == pytest.approx(300 / (120 + 120))
    assert by["loopback", "pufferfish", 1.0]["seconds"] == pytest.approx(55 + 30)
    projected = tta["projected"]
    assert projected["compute_ms"] == 10.0 and len(projected["table"]) == 2 * 3 * 2 * 2
    md = (out / "results.md").read_text()
    assert "## Time to accuracy: accuracy of the training runs" in md
    assert "| 100mbit | pufferfish | 1100.0 → 550.0 | 3 | 220 [200–240] | 1.50x [1.25–1.80] |" in md
    assert "PROJECTED for 8 and 64 workers" in md and "reused from" in md
    for png in ("time_to_accuracy.png", "time_to_accuracy_projected.png", "step_time.png"):
        assert (out / png).stat().st_size > 0


def test_accuracy_run_of_another_batch_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ddp = write_train_run(tmp_path / "full", DDP_ROWS, batch_size=128)
    saved = _bench_results(tmp_path / "saved.json")
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={ddp}",
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "batch_size 128" in err and "batch_size 64" in err
    assert not (tmp_path / "out").exists()


def test_runs_of_one_process_at_the_same_global_batch_are_timed_as_the_bench_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One GPU at batch 128 makes the same steps per epoch as the bench's 2 workers x 64: with
    # --accuracy-processes 1 its curve is timed exactly like the 2 x 64 run's.
    saved = _bench_results(tmp_path / "saved.json")
    one = {m: write_train_run(tmp_path / f"one-{m}", rows, batch_size=128, **extra)
           for m, rows, extra in (("ddp", DDP_ROWS, {}),
                                  ("pufferfish", PUFF_ROWS, {"mode": "pufferfish",
                                                             "warmup_epochs": "1"}))}
    two = {m: write_train_run(tmp_path / f"two-{m}", rows, **extra)
           for m, rows, extra in (("ddp", DDP_ROWS, {}),
                                  ("pufferfish", PUFF_ROWS, {"mode": "pufferfish",
                                                             "warmup_epochs": "1"}))}
    tables = []
    for runs, flags in ((one, ["--accuracy-processes", "1"]), (two, [])):
        out = tmp_path / f"out{len(tables)}"
        rc = main(["bench", "--from-results", str(saved), "--accuracy-runs",
                   ",".join(f"{m}={d}" for m, d in runs.items()), *flags, "--out", str(out)])
        assert rc == 0, capsys.readouterr().err
        tables.append(json.loads((out / "results.json").read_text())["time_to_accuracy"]
                      ["measured"]["table"])
    assert tables[0] == tables[1]
    assert "the runs used 1 process(es) at the same global batch" in (
        tmp_path / "out0" / "results.md").read_text()
    assert "the runs used 2 processes" in (tmp_path / "out1" / "results.md").read_text()
    # ...and a global batch that differs is refused in one line naming both.
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={one['ddp']}",
               "--accuracy-processes", "4", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "128 x 4 processes" in err and "64 x 2 workers" in err
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={one['ddp']}",
               "--accuracy-processes", "-1", "--out", str(tmp_path / "bad")])
    assert rc == 2 and "accuracy_processes -1 is invalid" in capsys.readouterr().err


def test_full_rank_method_with_low_rank_epochs_is_refused(tmp_path: Path) -> None:
    run = write_train_run(tmp_path / "x", PUFF_ROWS)  # a "full" config but low-rank rows
    with pytest.raises(ValueError, match="low-rank epochs but ddp is full-rank"):
        acc.load_accuracy_runs(f"ddp={run}", model="resnet18", width=0.25, batch_size=64,
                               powersgd_rank=4)


def test_runs_too_small_for_an_epoch_are_refused_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2,000 examples: 15 steps per epoch on the bench's 2 workers, none at the projection's 64
    # (2000 // 64 < 64): an epoch of no steps takes no time, which was a ZeroDivisionError.
    saved = _bench_results(tmp_path / "saved.json")
    runs = {m: write_train_run(tmp_path / m, DDP_ROWS, train_subset=n) for m, n in
            (("ddp", 2000), ("tiny", 100))}
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={runs['ddp']}",
               "--compute-ms", "12", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "--compute-ms" in err and "2000 training examples" in err and ">= 4096" in err
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={runs['tiny']}",
               "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--accuracy-runs" in err and ">= 128 examples" in err
    # Without the projection, 2,000 examples are enough.
    rc = main(["bench", "--from-results", str(saved), "--accuracy-runs", f"ddp={runs['ddp']}",
               "--out", str(tmp_path / "c")])
    assert rc == 0, capsys.readouterr().err
