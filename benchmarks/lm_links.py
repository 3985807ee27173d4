"""The budget study over slow links: time to a target perplexity at 20 tokens per parameter.

Six methods of ``benchmarks/lm_budget.py``'s recipe (llama width 0.125, 16,384 tokens a step,
AdamW, seed 0), full-rank ones at full rank's LR chosen on validation and Pufferfish ones as the
setting chosen there (``best_pufferfish``) at its LR: DDP and Pufferfish are the study's own
runs; PowerSGD and DiLoCo (AdamW inner steps) each get the study's LR rule (its grid at rank 4 /
H = 30, grown past an edge, chosen on validation), then as many settings of their own as
Pufferfish had (``SETTINGS``: PowerSGD's rank and start step, DiLoCo's H and outer LR) at that LR,
chosen on validation; Pufferfish + PowerSGD and Pufferfish + DiLoCo run at their baseline's LR and
setting; all are trained here into ``OUT/links/``, and the bench times each at its chosen rank and
H (a PowerSGD run's first steps, before its start step, at DDP's step time).
``pufferfish bench`` measures the same model's step time of each method over loopback and
emulated links (the same optimizer, AdamW, for every method); the time to the target is the steps a run needed to reach it times those step times
(before a Pufferfish switch at its full-rank counterpart's).

    python benchmarks/lm_links.py run OUT [--dry-run]          # the trials and the runs
    sudo python benchmarks/lm_links.py bench OUT [--bandwidth loopback,100mbit,10mbit]
    python benchmarks/lm_links.py table OUT [--md FILE]

The target is DDP's final validation perplexity + 5%, crossed on the validation curve (every
100 steps, log-linear between evaluations): test perplexity is measured once, at the end (its
column), so a crossing cannot be read on it.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import lm_budget as study
import sweep

from pufferfish.bench import time_to_target as ttt

H = 30  # DiLoCo's inner steps by default (its checkpoints fall on outer steps)


def diloco(inner: int, outer_lr: float | None = None) -> list[str]:
    """DiLoCo's train flags: ``inner`` steps between outer steps, checkpoints on outer steps."""
    return ["--sync", "diloco", "--inner-steps", str(inner), "--checkpoint-every-steps",
            str(inner * max(1, 300 // inner)),
            *([] if outer_lr is None else ["--outer-lr", f"{outer_lr:g}"])]


DILOCO = diloco(H)
# bench method -> (factorized: the chosen Pufferfish setting, else full rank; extra train flags)
LINK_METHODS: dict[str, tuple[bool, list[str]]] = {
    "ddp": (False, []),
    "powersgd": (False, ["--comm", "powersgd"]),
    "pufferfish": (True, []),
    "pufferfish+powersgd": (True, ["--comm", "powersgd"]),
    "diloco": (False, DILOCO),
    "pufferfish+diloco": (True, DILOCO),
}
FULL_PHASE = {"pufferfish": "ddp", "pufferfish+powersgd": "powersgd",
              "pufferfish+diloco": "diloco"}  # what a Pufferfish run is before its switch
TARGET_MARGIN = 0.05
BENCH = ["--model", "llama", "--width", "0.125", "--vocab-size", "1024", "--seq-len", "128",
         "--batch-size", "64", "--threads", "1", "--bucket-mb", "torch",
         "--steps", "10", "--warmup", "3", "--compute-steps", "5", "--rounds", "2"]


# The compressed and infrequent baselines get the study's LR rule (full rank's base grid, grown
# past an edge while the best sits there); a composition with Pufferfish takes its baseline's LR,
# as Pufferfish's settings take theirs.
TUNED = ("powersgd", "diloco")
STEPS = 681  # the study's optimizer steps at 20 tokens per parameter (width 0.125)
PSGD_START = round(0.1 * STEPS)  # torch's advice: plain all-reduce for ~10% of the updates
# Then each tuned baseline's own knobs, tried once each at its chosen LR and chosen on validation
# with its default ("default": the LR trial's run), as many settings beside the default as
# Pufferfish's had (11, lm_budget.VARIANTS): PowerSGD's rank and start step, DiLoCo's H and outer
# LR. A composition with Pufferfish runs at its baseline's chosen setting.
SETTINGS: dict[str, dict[str, list[str]]] = {
    "powersgd": {f"r{r}-st{st}": ["--powersgd-rank", str(r), "--powersgd-start-iter", str(st)]
                 for st in (10, PSGD_START) for r in (1, 2, 4, 8, 16, 32) if (r, st) != (4, 10)},
    "diloco": {f"h{h}-olr{o:g}": diloco(h, o) for h in (5, 10, 30, 100) for o in (0.3, 0.7, 1.0)
               if (h, o) != (H, 0.7)},
}


def _links_dir(out: Path, method: str, lr: float, setting: str = "default") -> Path:
    name = method if setting == "default" else f"{method}-{setting}"
    return out / "links" / f"{name}-lr{lr:g}-s0"


def _val_of(out: Path, method: str) -> Callable[[float], float | None]:
    return lambda lr: study.best_val(_links_dir(out, method, lr))


def chosen_setting(out: Path, baseline: str, lr: float | None) -> str | None:
    """The baseline's setting with the lowest final validation perplexity at its chosen ``lr``
    (its default or one of :data:`SETTINGS`); None until every one has finished."""
    if lr is None:
        return None
    vals = {s: study.best_val(_links_dir(out, baseline, lr, s))
            for s in ("default", *SETTINGS[baseline])}
    if any(v is None for v in vals.values()):
        return None
    return min(vals, key=lambda s: vals[s])  # type: ignore[arg-type,return-value]


def settings_tried(out: Path) -> dict[str, int]:
    """Per tuned baseline, how many of its :data:`SETTINGS` have run at its chosen LR."""
    lrs = {m: study.pick(study.METHODS["full"][1], _val_of(out, m)) for m in TUNED}
    return {m: 0 if lr is None else sum(study.finished(_links_dir(out, m, lr, s)) is not None
                                        for s in SETTINGS[m]) for m, lr in lrs.items()}


def _setting_flags(baseline: str, setting: str | None) -> list[str]:
    return [] if setting in (None, "default") else SETTINGS[baseline][setting]


def runs(out: Path) -> dict[str, tuple[Path | None, list[str], float | None]]:
    """Method -> (run directory, train flags, LR), directory and LR None while a tuned
    baseline's LR grid is unfinished (its default setting until all its settings have run);
    empty until the study has chosen its LRs."""
    full_lr, puff = study.chosen_lr(out, "full"), study.best_pufferfish(out)
    puff_lr = None if puff is None else study.chosen_lr(out, puff)
    if full_lr is None or puff is None or puff_lr is None:
        return {}
    tuned = {m: study.pick(study.METHODS["full"][1], _val_of(out, m)) for m in TUNED}
    # until a baseline's settings have all run, its default stands (settings_tried says so)
    setting = {m: chosen_setting(out, m, tuned[m]) or "default" for m in TUNED}
    found: dict[str, tuple[Path | None, list[str], float | None]] = {}
    for method, (factorized, extra) in LINK_METHODS.items():
        base, baseline = puff if factorized else "full", FULL_PHASE.get(method, method)
        lr = tuned.get(baseline, puff_lr if factorized else full_lr)
        knobs = _setting_flags(baseline, setting.get(baseline))
        path = (None if lr is None else study.run_dir(out, study.LR_BUDGET, base, lr, 0)
                if not extra else _links_dir(out, method, lr, setting.get(baseline, "default")))
        found[method] = (path, [*study.flags(base), *extra, *knobs], lr)
    return found


def run_knobs(path: Path) -> dict[str, int]:
    """The step-time knobs a run trained with, as the bench names them (PowerSGD's rank,
    DiLoCo's H), from its config.toml (the keys it lacks ran the defaults: 4 and 30)."""
    config = tomllib.loads((path / "config.toml").read_text())
    return {"powersgd_rank": int(config.get("powersgd_rank", 4)),
            "inner_steps": int(config.get("inner_steps", H))}


def bench_flags(out: Path) -> list[str] | None:
    """The bench's flags for the chosen PowerSGD rank and DiLoCo H (None: not chosen yet)."""
    found = runs(out)
    paths = {m: found[m][0] for m in TUNED} if found else {}
    if not paths or any(p is None or study.finished(p) is None for p in paths.values()):
        return None
    rank = run_knobs(paths["powersgd"])["powersgd_rank"]  # type: ignore[arg-type]
    inner = run_knobs(paths["diloco"])["inner_steps"]  # type: ignore[arg-type]
    return ["--powersgd-rank", str(rank), "--inner-steps", str(inner)]


def todo(out: Path) -> list[tuple[Path, list[str], float]]:
    """The runs still to train, in order: the tuned baselines' LR trials (one LR of each
    before a second), then their settings at their chosen LRs (likewise interleaved), then
    every method at its chosen LR and setting."""
    found = runs(out)
    base = study.METHODS["full"][1]
    grids = {m: study.trial_order(base, _val_of(out, m)) for m in TUNED}
    trials = [(_links_dir(out, m, lr), [*study.flags("full"), *LINK_METHODS[m][1]], lr)
              for m, lr in study.interleaved(grids)]
    tuned = {m: study.pick(base, _val_of(out, m)) for m in TUNED}
    knobs = [[(_links_dir(out, m, lr, s), [*study.flags("full"), *LINK_METHODS[m][1], *flags],
               lr) for s, flags in SETTINGS[m].items()]
             for m, lr in tuned.items() if lr is not None]
    settings = [t for row in itertools.zip_longest(*knobs) for t in row if t is not None]
    chosen = [(path, flags, lr) for path, flags, lr in found.values()
              if path is not None and lr is not None]
    pending: dict[Path, tuple[Path, list[str], float]] = {}
    for path, flags, lr in [*trials, *settings, *chosen]:  # a chosen run is one of its trials
        if study.finished(path) is None:
            pending.setdefault(path, (path, flags, lr))
    return list(pending.values())


def _curve(path: Path) -> list[tuple[int, float]]:
    """(step, validation perplexity) of every evaluation and the end."""
    rows = [json.loads(r) for r in (path / "evals.jsonl").read_text().splitlines() if r]
    last = study.finished(path) or {}
    points = [(r["step"], r["val_ppl"]) for r in rows]
    if last and (not points or points[-1][0] < last["steps"]):
        points.append((last["steps"], last["val_ppl"]))
    return points


def steps_to(points: list[tuple[int, float]], target: float) -> float | None:
    """The step where the curve first reaches ``target`` (log-linear between evaluations;
    None: never)."""
    at = ttt.reach([(s, math.log(p)) for s, p in points], math.log(target), interpolate=True)
    return None if at is None else float(at)


def switch_step(path: Path) -> int:
    """The step a Pufferfish run switched at (0 for a full-rank run)."""
    report = path / "factorization.json"
    return json.loads(report.read_text())["step"] if report.is_file() else 0


def step_times(bench: Path) -> dict[tuple[str, str], dict]:
    """(method, link) -> the bench's row: step time (median over rounds) and its spread."""
    data = json.loads((bench / "results.json").read_text())
    return {(r["method"], r["bandwidth"]): r for r in data["rows"]}


def start_step(path: Path) -> int:
    """The steps a PowerSGD run all-reduced plainly before compressing (0 for other runs)."""
    config = tomllib.loads((path / "config.toml").read_text())
    return int(config.get("powersgd_start_iter", 10)) if config.get("comm") == "powersgd" else 0


def phases(row: dict, times: dict[str, tuple[float, float, float] | None]
           ) -> list[tuple[float, ttt.StepTime]] | None:
    """A ``results`` row's steps in phases of one step time each, from ``times`` (method ->
    (median, low, high) over one link): PowerSGD's first ``start`` steps are a plain all-reduce
    (DDP's time); a Pufferfish run steps at its full-rank counterpart's time until its switch,
    and a composition with PowerSGD, whose hook starts again on the factorized model, all-reduces
    plainly (Pufferfish's time) for ``start`` steps more. None: a needed time is missing."""
    method, start, switch = row["method"], row["start_step"], row["switch_step"]
    parts = [(min(start, switch) if method in FULL_PHASE else start, "ddp")]
    if method in FULL_PHASE:
        parts += [(switch - parts[0][0], FULL_PHASE[method]), (start, "pufferfish")]
    parts = [(n, m) for n, m in parts if n > 0] + [(math.inf, method)]
    if any(times.get(m) is None for _, m in parts):
        return None
    return [(n, ttt.StepTime(*times[m])) for n, m in parts]  # type: ignore[misc]


def seconds_to(row: dict, times: dict[str, tuple[float, float, float] | None]
               ) -> ttt.StepTime | None:
    """A ``results`` row's seconds to the target at the bench's median step times, in its best
    round and in its worst (:func:`phases`; ``times``: every method's step time over one link).
    None: not reached or not timed."""
    steps = phases(row, times)
    if row["steps_to_target"] is None or steps is None:
        return None
    return ttt.time_range(row["steps_to_target"], steps)


def _spread(bench_row: dict | None) -> tuple[float, float, float] | None:
    """A bench row's step time: (median, low, high) over its rounds."""
    return None if bench_row is None else (bench_row["step_time"],
                                           *bench_row["spread"]["step_time"])


def results(out: Path) -> dict | str:
    """The target and, per method, its run's figures, the bench's step time per link and the
    time to the target per link (None: not reached); a string saying what is missing."""
    found = runs(out)
    bench = out / "links" / "bench"
    if not found or not (bench / "results.json").is_file():
        return "lm_links: the study's LRs, the four runs and the bench are all needed first"
    times = step_times(bench)
    bench_config = json.loads((bench / "results.json").read_text()).get("config", {})
    links = list(dict.fromkeys(link for _, link in times))
    ddp_last = study.finished(found["ddp"][0])  # type: ignore[arg-type]
    if ddp_last is None:
        return "lm_links: DDP's run has not finished"
    target = ddp_last["val_ppl"] * (1 + TARGET_MARGIN)
    rows = []
    for method, (path, _, lr) in found.items():
        last = None if path is None else study.finished(path)
        if last is None:
            rows.append({"method": method, "lr": lr, "run": None})
            continue
        mine = {link: times.get((method, link)) for link in links}
        bench_params = next((r["params"] for r in mine.values() if r), None)
        if bench_params not in (None, last["params"]):
            return (f"lm_links: the bench's {method} has {bench_params} parameters, its run "
                    f"{path} {last['params']}: not the same model")
        knobs = run_knobs(path)
        key = {"powersgd": "powersgd_rank", "diloco": "inner_steps"}.get(
            FULL_PHASE.get(method, method))
        if key and bench_config.get(key, knobs[key]) != knobs[key]:
            return (f"lm_links: the bench measured {key} {bench_config[key]}, the chosen run "
                    f"{path} trained with {knobs[key]}: run `lm_links.py bench` again")
        row = {"method": method, "lr": lr, "run": str(path), "params": last["params"],
               "val_ppl": last["val_ppl"], "test_ppl": last["test_ppl"],
               "mb_per_step": last["comm_bytes_per_step"] / 1e6,
               "steps_to_target": steps_to(_curve(path), target),
               "switch_step": switch_step(path), "start_step": start_step(path),
               "step_s": {link: _spread(r) for link, r in mine.items()}}
        rows.append(row)
    for row in rows:
        if row["run"] is not None:
            row["seconds_to_target"] = {
                link: None if (t := seconds_to(row, link_times(rows, link))) is None
                else t.median for link in links}
    return {"target": target, "ddp_val_ppl": ddp_last["val_ppl"], "links": links, "rows": rows}


def link_times(rows: list[dict], link: str) -> dict[str, tuple[float, float, float] | None]:
    """Every timed row's step time over ``link``: method -> (median, low, high)."""
    return {r["method"]: r["step_s"][link] for r in rows if r.get("step_s")}


def first(found: dict, link: str) -> str | None:
    """The method that reaches the target soonest over ``link`` (None: none does)."""
    timed = {r["method"]: r["seconds_to_target"][link] for r in found["rows"]
             if r.get("seconds_to_target", {}).get(link) is not None}
    return min(timed, key=timed.__getitem__) if timed else None


def round_times(row: dict, rows: list[dict], link: str) -> tuple[float, float] | None:
    """A row's time to the target over ``link`` in the bench's best and worst rounds (each phase
    of its steps at its method's step time); None if it never reaches the target."""
    t = seconds_to(row, link_times(rows, link))
    return None if t is None else (t.low, t.high)


def verdict(found: dict, link: str) -> tuple[str | None, str | None, bool]:
    """The method first by medians over ``link``, its nearest rival (the other method with the
    fastest best round), and whether its worst round beats every other method's best (the
    README's rule for times); else the two are within the rounds' spread, a tie."""
    rows = [r for r in found["rows"] if r["run"] is not None]
    winner = first(found, link)
    if winner is None:
        return None, None, False
    worst = round_times(next(r for r in rows if r["method"] == winner), rows, link)[1]
    others = {r["method"]: t[0] for r in rows if r["method"] != winner
              and (t := round_times(r, rows, link)) is not None}
    rival = min(others, key=others.__getitem__) if others else None
    return winner, rival, all(worst < best for best in others.values())


def _first_said(found: dict, link: str) -> str:
    """'100mbit: ddp by medians, a tie with pufferfish (the rounds overlap)'."""
    winner, rival, apart = verdict(found, link)
    if winner is None:
        return f"{link}: none"
    if apart:
        return f"{link}: {winner}" + (f", its worst round ahead of {rival}'s best" if rival else "")
    return f"{link}: {winner} by medians, a tie with {rival} (the rounds overlap)"


def table(out: Path) -> str:
    found = results(out)
    if isinstance(found, str):
        return found
    links = found["links"]
    lines = [f"Target: validation perplexity {found['target']:.2f} (DDP's final "
             f"{found['ddp_val_ppl']:.2f} + {TARGET_MARGIN:.0%}).", "",
             "| method | params | final val ppl | final test ppl | MB sent per step | steps to "
             "target | " + " | ".join(f"step ms, {link}" for link in links) + " | "
             + " | ".join(f"time to target, {link}" for link in links) + " |",
             "|---|---|---|---|---|---|" + "---|" * (2 * len(links))]
    for r in found["rows"]:
        if r["run"] is None:
            lines.append(f"| {r['method']} | not run yet |" + " |" * (4 + 2 * len(links)))
            continue
        ms = ["–" if r["step_s"][link] is None else
              "{:.0f} [{:.0f}–{:.0f}]".format(*(1e3 * t for t in r["step_s"][link]))
              for link in links]
        to = [("not reached" if r["steps_to_target"] is None else "–")
              if r["seconds_to_target"][link] is None else f"{r['seconds_to_target'][link]:,.0f} s"
              for link in links]
        reach = "–" if r["steps_to_target"] is None else f"{r['steps_to_target']:.0f}"
        lines.append(f"| {r['method']} (lr {r['lr']:g}) | {r['params'] / 1e6:.2f}M | "
                     f"{r['val_ppl']:.2f} | {r['test_ppl']:.2f} | {r['mb_per_step']:.3f} | "
                     f"{reach} | " + " | ".join(ms) + " | " + " | ".join(to) + " |")
    lines += ["", "First to the target (a time's worst round ahead of every other's best): "
              + "; ".join(_first_said(found, link) for link in links) + "."]
    return "\n".join(lines)


def main() -> int:
    parser, sub = sweep.parser(__doc__)
    b = sub.add_parser("bench")
    b.add_argument("out", type=Path)
    b.add_argument("--bandwidth", default="loopback,100mbit,10mbit")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    t.add_argument("--md", type=Path)
    args = parser.parse_args()
    found = runs(args.out)
    if not found:
        print("lm_links: the study has not chosen full rank's LR and a Pufferfish setting yet "
              "(benchmarks/lm_budget.py run OUT --phase lr, --phase variants)", file=sys.stderr)
        return 2
    if args.cmd == "run":  # until nothing is left: a finished grid may grow or choose
        while pending := todo(args.out):
            if args.dry_run:
                print("\n".join(f"would run: {path}" for path, _, _ in pending))
                return 0
            path, method_flags, lr = pending[0]
            if not study.train(path, method_flags, lr, 0, study.LR_BUDGET):
                return 1
        return 0
    if args.cmd == "bench":
        if (knobs := bench_flags(args.out)) is None:
            print("lm_links: PowerSGD's and DiLoCo's settings are not chosen yet (lm_links.py "
                  "run OUT first)", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "pufferfish", "bench", *BENCH, *knobs, "--methods",
               ",".join(LINK_METHODS), "--bandwidth", args.bandwidth,
               # --overwrite: run again to re-measure (at newly chosen settings, as table asks)
               "--out", str(args.out / "links" / "bench"), "--overwrite"]
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)
    text = table(args.out)
    print(text)
    if args.md is not None:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
