"""benchmarks/lm_budget.py's choices: an LR grid grows past the edge its best sits on, the LR is
chosen on validation, and the seeds phase runs the Pufferfish variant best on validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import lm_budget  # noqa: E402


def _finish(out: Path, method: str, lr: float, val: float, test: float = 0.0,
            budget: float = 20.0, seed: int = 0) -> None:
    _finish_at(lm_budget.run_dir(out, budget, method, lr, seed), val, test)


def _finish_at(path: Path, val: float, test: float = 0.0) -> None:
    path.mkdir(parents=True)
    row = {"val_ppl": val, "test_ppl": test or val, "params": 1000, "epoch_time": 1.0}
    (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_grid_grows_past_its_edge_until_the_best_is_inside(tmp_path: Path) -> None:
    for lr, val in ((1e-3, 30.0), (3e-3, 25.0), (1e-2, 22.0)):
        _finish(tmp_path, "full", lr, val)
    assert lm_budget.grid(tmp_path, "full") == [1e-3, 3e-3, 1e-2, 3e-2]
    assert lm_budget.chosen_lr(tmp_path, "full") is None  # 3e-2 not run yet: not chosen
    queued = lm_budget.queue(tmp_path, "lr", ["full"])
    assert [(m, lr) for _, m, lr, _ in queued] == [("full", 3e-2)]
    _finish(tmp_path, "full", 3e-2, 23.0)  # worse: 1e-2 is inside the grid now
    assert lm_budget.chosen_lr(tmp_path, "full") == 1e-2
    assert lm_budget.queue(tmp_path, "lr", ["full"]) == []


def test_grid_grows_downward_too(tmp_path: Path) -> None:
    for lr, val in ((1e-3, 20.0), (3e-3, 25.0), (1e-2, 40.0)):
        _finish(tmp_path, "lowrank", lr, val)
    assert lm_budget.grid(tmp_path, "lowrank")[0] == 3e-4


def test_seeds_phase_runs_the_variant_best_on_validation(tmp_path: Path) -> None:
    for lr, val in ((1e-3, 30.0), (3e-3, 25.0), (1e-2, 28.0)):
        _finish(tmp_path, "puff10proj", lr, val)
    _finish(tmp_path, "puff2proj", 3e-3, 24.0)  # a variant at its base method's LR, better
    assert lm_budget.chosen_lr(tmp_path, "puff2proj") == 3e-3
    assert lm_budget.best_pufferfish(tmp_path) == "puff2proj"
    queued = lm_budget.queue(tmp_path, "seeds", ["pufferfish"])
    assert {(m, lr) for _, m, lr, _ in queued} == {("puff2proj", 3e-3)}
    assert {(b, s) for b, _, _, s in queued} == {(b, s) for b in (20.0, 5.0, 1.0)
                                                 for s in (0, 1, 2)} - {(20.0, 0)}


def test_one_call_runs_the_runs_its_finished_runs_queue(tmp_path: Path, monkeypatch) -> None:
    """The width phase's Pufferfish run waits on full rank's LR choice: one ``run`` call trains
    it once the runs it depends on have finished; a run that fails is tried once, not forever."""
    import lm_width

    launched: list[tuple[str, float]] = []

    def launch(out: Path, budget: float, method: str, lr: float, seed: int, width: float) -> bool:
        launched.append((method, lr))
        if method == "lowrank" and lr == 1e-2:
            return False  # fails: leaves no finished run behind
        val = {"full": 10.0, "lowrank": 12.0}.get(method, 11.0) * (1 + (lr == 1e-2))
        _finish_at(lm_budget.run_dir(out, budget, method, lr, seed, width), val)
        return True

    monkeypatch.setattr(lm_budget, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["lm_budget.py", "run", str(tmp_path), "--phase", "width"])
    assert lm_budget.main() == 0
    assert launched == [("full", 3e-3), ("lowrank", 3e-3), ("full", 1e-2), ("lowrank", 1e-2),
                        (lm_width.PUFF, 3e-3)]


@pytest.mark.parametrize("bad", ["full,nope"])
def test_unknown_method_is_refused_in_one_line(tmp_path: Path, bad: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/lm_budget.py"), "run",
                           str(tmp_path), "--methods", bad, "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--methods" in done.stderr, done.stderr


def test_lag_is_constant_for_a_curve_shifted_in_lr_time(tmp_path: Path) -> None:
    """A run whose perplexities are the reference's one evaluation later lags by the LR summed
    between those evaluations."""
    curve = [(100, 300.0), (200, 100.0), (300, 50.0), (400, 30.0)]
    behind = list(zip((100, 200, 300, 400), (900.0, 300.0, 100.0, 50.0), strict=True))
    for method, points in (("lowrank", curve), ("puff10proj", behind)):
        path = lm_budget.run_dir(tmp_path, 20.0, method, 1e-2, 0)
        path.mkdir(parents=True)
        (path / "config.toml").write_text('model = "llama"\nlr = 0.01\nschedule = "constant"\n'
                                          "lr_warmup_epochs = 0.0\nepochs = 1\n")
        (path / "evals.jsonl").write_text("".join(json.dumps({"step": s, "val_ppl": p}) + "\n"
                                                  for s, p in points))
        last = {"steps": 500, "val_ppl": points[-1][1] * 0.9, "test_ppl": 1.0}
        (path / "metrics.jsonl").write_text(json.dumps(last) + "\n")
    table = lm_budget.lag(tmp_path, 1e-2)
    row = next(line for line in table.splitlines() if line.startswith("| puff10proj"))
    assert row.count("(+100)") == 3, table  # constant LR: one evaluation = 100 steps


@pytest.mark.parametrize(("puff_seeds", "puff_ppl", "matters"),
                         [(3, 23.5, False), (3, 22.5, True), (1, 22.5, None), (1, 23.5, None)])
def test_decision_rule(tmp_path: Path, puff_seeds: int, puff_ppl: float,
                       matters: bool | None) -> None:
    """Full rank 22 +- 0.1, low rank 24 +- 0.1 at 5 tokens/param: a gap of 2 > 2 x spread 0.2.
    Pufferfish at 22.5 recovers 75% of it (matters), at 23.5 25% (does not); either way no
    verdict before all of Pufferfish's seeds are in."""
    for m, grid_vals in (("full", (30.0, 25.0, 21.0, 23.0)), ("lowrank", (30.0, 25.0, 21.0, 23.0)),
                         ("puff10proj", (30.0, 25.0, 21.0, 23.0))):
        for lr, val in zip((1e-3, 3e-3, 1e-2, 3e-2), grid_vals, strict=True):
            _finish(tmp_path, m, lr, val)
    for seed, delta in enumerate((0.0, 0.1, -0.1)):
        _finish(tmp_path, "full", 1e-2, 22.0, 22.0 + delta, budget=5.0, seed=seed)
        _finish(tmp_path, "lowrank", 1e-2, 24.0, 24.0 + delta, budget=5.0, seed=seed)
    for seed in range(puff_seeds):
        _finish(tmp_path, "puff10proj", 1e-2, puff_ppl, puff_ppl, budget=5.0, seed=seed)
    rows = lm_budget.table(tmp_path)
    by_budget = {v["budget"]: v for v in lm_budget.verdicts(tmp_path, rows)}
    assert by_budget[5.0]["matters"] is matters, by_budget[5.0]["text"]
    assert by_budget[1.0]["matters"] is None  # no seeds there


def _curve_run(path: Path, curve: list[tuple[int, float]], params: int, switch: int = 0,
               config: str = "") -> None:
    """A finished run whose validation curve is ``curve`` (the last point its end), trained
    with ``config`` (its config.toml)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "evals.jsonl").write_text("".join(
        json.dumps({"step": s, "val_ppl": p}) + "\n" for s, p in curve[:-1]))
    steps, val = curve[-1]
    (path / "metrics.jsonl").write_text(json.dumps(
        {"val_ppl": val, "test_ppl": val, "params": params, "steps": steps, "epoch_time": 1.0,
         "comm_bytes_per_step": 4.0 * params}) + "\n")
    (path / "config.toml").write_text(config)
    if switch:
        (path / "factorization.json").write_text(json.dumps({"step": switch}))


def _links_study(tmp_path: Path) -> dict:
    """The links study's queue, from the LR trials through PowerSGD's and DiLoCo's settings to
    the chosen runs: PowerSGD best at rank 8 starting at step 68, DiLoCo at its default."""
    import lm_links

    for lr, val in ((1e-3, 30.0), (3e-3, 25.0), (1e-2, 28.0)):
        _finish(tmp_path, "full", lr, val)
        _finish(tmp_path, "puff10proj", lr, val)
    assert [lr for _, _, lr in lm_links.todo(tmp_path)] == [3e-3, 3e-3, 1e-2, 1e-2, 1e-3, 1e-3]
    links = tmp_path / "links"
    for lr, val in ((1e-3, 40.0), (3e-3, 45.0), (1e-2, 50.0)):  # PowerSGD best at its edge
        _finish_at(links / f"powersgd-lr{lr:g}-s0", val)
    for lr, val in ((1e-3, 45.0), (3e-3, 40.0), (1e-2, 50.0)):  # DiLoCo best inside
        _finish_at(links / f"diloco-lr{lr:g}-s0", val)
    # PowerSGD's grid grows; DiLoCo's settings start at its chosen LR, its composition after them
    diloco = [f"diloco-{s}-lr0.003-s0" for s in lm_links.SETTINGS["diloco"]]
    assert [p.name for p, _, _ in lm_links.todo(tmp_path)] == [
        "powersgd-lr0.0003-s0", *diloco, "pufferfish+diloco-lr0.003-s0"]
    assert len(diloco) == len(lm_links.SETTINGS["powersgd"]) == 11  # as many as Pufferfish's
    runs = lm_links.runs(tmp_path)
    assert runs["powersgd"][0] is None and runs["pufferfish+powersgd"][2] is None
    assert runs["diloco"][0].name == "diloco-lr0.003-s0"  # its default until its settings ran
    assert lm_links.settings_tried(tmp_path) == {"powersgd": 0, "diloco": 0}
    _finish_at(links / "powersgd-lr0.0003-s0", 60.0)  # worse: 1e-3 chosen
    pending = [(p.name, flags) for p, flags, _ in lm_links.todo(tmp_path)]
    assert [n for n, _ in pending[:3]] == ["powersgd-r1-st10-lr0.001-s0", diloco[0],
                                           "powersgd-r2-st10-lr0.001-s0"]  # interleaved
    assert pending[0][1][-4:] == ["--powersgd-rank", "1", "--powersgd-start-iter", "10"]
    for name, _ in pending:
        if name.startswith(("powersgd-", "diloco-")):  # the settings (the rest recomputed)
            _finish_at(links / name, 35.0 if name.startswith("powersgd-r8-st68") else 41.0)
    runs = lm_links.runs(tmp_path)
    assert lm_links.settings_tried(tmp_path) == {"powersgd": 11, "diloco": 11}
    assert set(runs) == set(lm_links.LINK_METHODS) and runs["ddp"][2] == 3e-3
    assert runs["pufferfish+powersgd"][2] == runs["powersgd"][2] == 1e-3
    assert runs["powersgd"][0].name == "powersgd-r8-st68-lr0.001-s0"
    assert runs["pufferfish+powersgd"][0].name == "pufferfish+powersgd-r8-st68-lr0.001-s0"
    assert runs["pufferfish+powersgd"][1][-4:] == ["--powersgd-rank", "8",
                                                   "--powersgd-start-iter", "68"]
    assert runs["diloco"][0].name == "diloco-lr0.003-s0"  # the default stays the best
    assert runs["diloco"][1][-6:-2] == ["--sync", "diloco", "--inner-steps", "30"]
    return runs


def test_links_time_to_target_is_steps_to_it_times_each_phases_step(tmp_path: Path) -> None:
    """DDP ends at 20.0 (target 21.0); Pufferfish + DiLoCo crosses it halfway between steps 100
    and 200 in log perplexity; its 30 steps before the switch take DiLoCo's step time. Pufferfish
    + PowerSGD (starting at step 68) crosses there too: 30 steps at DDP's time (PowerSGD's first
    steps all-reduce plainly), its hook again plain for 68 steps after the switch (Pufferfish's
    time), then its own."""
    import lm_links

    runs = _links_study(tmp_path)
    full, puff = 1000, 600
    for method, (path, _, _) in runs.items():
        shutil.rmtree(path, ignore_errors=True)  # the trials' own rows, replaced by curves
        factorized = method.startswith("pufferfish")
        low = 21.0  # at step 100: 21^2 / 19, so 21.0 is halfway in log to step 200's 19.0
        curve = ([(100, low * low / 19.0), (200, 19.0), (300, 18.5)]
                 if method in ("pufferfish+diloco", "pufferfish+powersgd")
                 else [(100, 40.0), (200, 30.0), (300, 20.0)] if method == "ddp"
                 else [(100, 50.0), (200, 45.0), (300, 24.0 if method == "pufferfish" else 34.0)])
        config = ('comm = "powersgd"\npowersgd_rank = 8\npowersgd_start_iter = 68\n'
                  if "powersgd" in method else "inner_steps = 30\n" if "diloco" in method else "")
        _curve_run(path, curve, puff if factorized else full, switch=30 if factorized else 0,
                   config=config)
    assert lm_links.bench_flags(tmp_path) == ["--powersgd-rank", "8", "--inner-steps", "30"]
    bench = tmp_path / "links" / "bench"
    bench.mkdir(parents=True)
    rows = [{"method": m, "bandwidth": "10mbit", "step_time": t, "params": p,
             "spread": {"step_time": [t, t]}}
            for m, t, p in (("ddp", 2.0, full), ("diloco", 0.5, full), ("pufferfish+diloco", 0.25, puff),
                            ("powersgd", 1.0, full), ("pufferfish", 1.5, puff),
                            ("pufferfish+powersgd", 0.9, puff))]
    config = {"powersgd_rank": 8, "inner_steps": 30}
    (bench / "results.json").write_text(json.dumps({"config": config, "rows": rows}))
    table = lm_links.table(tmp_path)
    line = next(x for x in table.splitlines() if x.startswith("| pufferfish+diloco"))
    # reached at step 150: 30 steps at DiLoCo's 0.5 s, 120 at its own 0.25 s = 45 s
    assert "| 150 |" in line and line.rstrip(" |").endswith("45 s"), line
    line = next(x for x in table.splitlines() if x.startswith("| pufferfish+powersgd"))
    # 30 x 2.0 (DDP) + 68 x 1.5 (Pufferfish) + 52 x 0.9 (its own) = 208.8 s
    assert line.rstrip(" |").endswith("209 s"), line
    ddp = next(x for x in table.splitlines() if x.startswith("| ddp"))
    assert "| 288 |" in ddp, ddp  # 30 -> 20 over steps 200-300: 21 is log(30/21) / log(30/20) = 0.88 in
    assert "not reached" in next(x for x in table.splitlines() if x.startswith("| powersgd"))
    assert table.endswith("10mbit: pufferfish+diloco, its worst round ahead of "
                          "pufferfish+powersgd's best."), table
    rows[2]["spread"]["step_time"] = [0.25, 2.0]  # its worst round: 30 x 0.5 + 120 x 2.0 = 255 s
    (bench / "results.json").write_text(json.dumps({"config": config, "rows": rows}))
    found = lm_links.results(tmp_path)
    assert lm_links.verdict(found, "10mbit") == ("pufferfish+diloco", "pufferfish+powersgd", False)
    assert lm_links.table(tmp_path).endswith(
        "10mbit: pufferfish+diloco by medians, a tie with pufferfish+powersgd (the rounds overlap).")
    rows[2]["spread"]["step_time"] = [0.25, 0.25]
    (bench / "results.json").write_text(json.dumps({"config": {**config, "powersgd_rank": 4},
                                                    "rows": rows}))
    assert "the bench measured powersgd_rank 4" in lm_links.table(tmp_path)
    rows[0]["params"] = 999  # the bench measured another model: refused, not mixed
    (bench / "results.json").write_text(json.dumps({"config": config, "rows": rows}))
    assert "not the same model" in lm_links.table(tmp_path)


def test_llama_s_defaults_are_the_cached_study_s_choices() -> None:
    """The default LR and method at each measured width are what the budget study chose there on
    validation (width 0.125: low rank from the start and its LR); a finished width study whose
    choice the defaults do not carry fails here until they do."""
    import lm_width

    from pufferfish.models.llama import LLAMA_LR_AT_EDGE, LLAMA_LR_MEASURED, LLAMA_METHOD_MEASURED

    cache = ROOT / "benchmarks" / "results" / "lm-budget"
    assert LLAMA_METHOD_MEASURED[lm_budget.WIDTH] == "lowrank"
    assert LLAMA_LR_MEASURED[lm_budget.WIDTH] == lm_budget.chosen_lr(cache, "lowrank")
    found = lm_width.verdict(cache)
    if found is None:  # the width study is still running: its width is not measured advice yet
        assert set(LLAMA_LR_MEASURED) == set(LLAMA_METHOD_MEASURED) == {lm_budget.WIDTH}
    else:
        chosen = "lowrank" if found["default"] == "lowrank" else lm_width.PUFF
        assert LLAMA_METHOD_MEASURED[lm_width.WIDE] == found["default"], found["text"]
        assert LLAMA_LR_MEASURED[lm_width.WIDE] == found["lrs"][chosen], found["text"]
    # --help says where the chosen LR is the lowest or highest of those tried (a bound)
    tried = {lm_budget.WIDTH: sorted({float(d.name.split("-lr")[1].split("-s")[0])
                                      for d in (cache / "tpp20").glob("lowrank-lr*-s0")})}
    if found is not None:
        tried[lm_width.WIDE] = sorted(lm_width.lrs(cache, lm_width.WIDE))
    for width, lrs in tried.items():
        edge = {lrs[0]: "lowest", lrs[-1]: "highest"}.get(LLAMA_LR_MEASURED[width])
        assert LLAMA_LR_AT_EDGE.get(width) == edge, (width, lrs)


@pytest.mark.parametrize("puff,default", [(11.5, "lowrank"), (10.5, "pufferfish")])
def test_the_width_verdict_is_the_lower_mean_validation_with_its_distances(
        tmp_path: Path, puff: float, default: str) -> None:
    """Width 0.25's rule on constructed runs beside the cached width-0.125 study: each method at
    its better LR, a second seed queued while full and low rank are within the resolution, the
    default the candidate with the lower mean validation perplexity, each distance to full rank
    stated, and this width's own seed spread beside it."""
    import lm_width

    shutil.copytree(ROOT / "benchmarks/results/lm-budget/tpp20", tmp_path / "tpp20")
    at = lambda m, lr, seed, val: _finish_at(  # noqa: E731
        lm_budget.run_dir(tmp_path, 20.0, m, lr, seed, lm_width.WIDE), val)
    for method, good in (("full", 10.0), ("lowrank", 11.0)):
        at(method, 3e-3, 0, good)
        at(method, 1e-2, 0, 2 * good)
    assert lm_width.lrs(tmp_path) == [3e-3, 1e-2] and lm_width.verdict(tmp_path) is None
    at(lm_width.PUFF, 3e-3, 0, puff)
    assert [t[1:4] for t in lm_width.queue(tmp_path)] == [("full", 3e-3, 1), ("lowrank", 3e-3, 1)]
    at("full", 3e-3, 1, 10.2)
    at("lowrank", 3e-3, 1, 11.2)
    found = lm_width.verdict(tmp_path)
    assert found is not None and found["default"] == default
    assert found["vals"]["lowrank"] == (pytest.approx(11.1), 2)
    gap_low, gap_puff = 11.1 / 10.1 - 1, puff / 10.1 - 1
    assert f"low rank from the start {gap_low:+.1%}" in found["text"]
    assert f"Pufferfish's 10% switch {gap_puff:+.1%}" in found["text"]
    assert f"full {0.2 / 10.1:.1%}, lowrank {0.2 / 11.1:.1%}" in found["text"]
