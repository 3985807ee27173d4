"""The budget study over slow links: time to a target perplexity at 20 tokens per parameter.

Six methods of ``benchmarks/lm_budget.py``'s recipe (llama width 0.125, 16,384 tokens a step,
AdamW, seed 0), full-rank ones at full rank's LR chosen on validation and Pufferfish ones as the
setting chosen there (``best_pufferfish``) at its LR: DDP and Pufferfish are the study's own
runs; PowerSGD (rank 4) and DiLoCo (H = 30, AdamW inner steps) each get the study's LR rule (its
grid, grown past an edge, chosen on validation), Pufferfish + PowerSGD and Pufferfish + DiLoCo
run at their baseline's chosen LR; all four are trained here into ``OUT/links/``.
``pufferfish bench`` measures the same model's step time of each method over loopback and
emulated links (the same optimizer, AdamW, for every method); the time to the target is the steps a run needed to reach it times those step times
(before a Pufferfish switch at its full-rank counterpart's).

    python benchmarks/lm_links.py run OUT [--dry-run]          # the LR trials and the runs
    sudo python benchmarks/lm_links.py bench OUT [--bandwidth loopback,100mbit,10mbit]
    python benchmarks/lm_links.py table OUT [--md FILE]

The target is DDP's final validation perplexity + 5%, crossed on the validation curve (every
100 steps, log-linear between evaluations): test perplexity is measured once, at the end (its
column), so a crossing cannot be read on it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lm_budget as study
import sweep

from pufferfish.bench import time_to_target as ttt

H = 30  # DiLoCo's inner steps; its checkpoints fall on outer steps (the study's every 100 cannot)
DILOCO = ["--sync", "diloco", "--inner-steps", str(H), "--checkpoint-every-steps", str(10 * H)]
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
         "--batch-size", "64", "--threads", "1", "--bucket-mb", "torch", "--inner-steps", str(H),
         "--steps", "10", "--warmup", "3", "--compute-steps", "5", "--rounds", "2"]


# The compressed and infrequent baselines get the study's LR rule (full rank's base grid, grown
# past an edge while the best sits there); a composition with Pufferfish takes its baseline's LR,
# as Pufferfish's settings take theirs.
TUNED = ("powersgd", "diloco")


def _links_dir(out: Path, method: str, lr: float) -> Path:
    return out / "links" / f"{method}-lr{lr:g}-s0"


def _val_of(out: Path, method: str) -> Callable[[float], float | None]:
    return lambda lr: study.best_val(_links_dir(out, method, lr))


def runs(out: Path) -> dict[str, tuple[Path | None, list[str], float | None]]:
    """Method -> (run directory, train flags, LR), directory and LR None while a tuned
    baseline's grid is unfinished; empty until the study has chosen its LRs."""
    full_lr, puff = study.chosen_lr(out, "full"), study.best_pufferfish(out)
    puff_lr = None if puff is None else study.chosen_lr(out, puff)
    if full_lr is None or puff is None or puff_lr is None:
        return {}
    tuned = {m: study.pick(study.METHODS["full"][1], _val_of(out, m)) for m in TUNED}
    found: dict[str, tuple[Path | None, list[str], float | None]] = {}
    for method, (factorized, extra) in LINK_METHODS.items():
        base = puff if factorized else "full"
        lr = tuned.get(FULL_PHASE.get(method, method), puff_lr if factorized else full_lr)
        path = (None if lr is None else study.run_dir(out, study.LR_BUDGET, base, lr, 0)
                if not extra else _links_dir(out, method, lr))
        found[method] = (path, [*study.flags(base), *extra], lr)
    return found


def todo(out: Path) -> list[tuple[Path, list[str], float]]:
    """The runs still to train, in order: the tuned baselines' LR trials (one LR of each
    before a second), then every method at its chosen LR."""
    found = runs(out)
    base = study.METHODS["full"][1]
    grids = {m: study.trial_order(base, _val_of(out, m)) for m in TUNED}
    trials = [(_links_dir(out, m, lr), found[m][1], lr) for m, lr in study.interleaved(grids)]
    chosen = [(path, flags, lr) for path, flags, lr in found.values()
              if path is not None and lr is not None]
    pending: dict[Path, tuple[Path, list[str], float]] = {}
    for path, flags, lr in [*trials, *chosen]:  # a chosen LR's run is one of its trials
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


def seconds_to(row: dict, before: tuple[float, float, float] | None,
               link: str) -> ttt.StepTime | None:
    """A ``results`` row's seconds to the target over ``link`` at the bench's median step times,
    in its best round and in its worst; ``before``: the step times (median, low, high) of its
    full-rank counterpart, at which a Pufferfish run steps until its switch. None: not reached or
    not timed."""
    own = row["step_s"][link]
    if row["steps_to_target"] is None or own is None or before is None:
        return None
    switch = switch_step(Path(row["run"])) if row["method"] in FULL_PHASE else 0
    return ttt.time_range(row["steps_to_target"], [(switch, ttt.StepTime(*before)),
                                                   (math.inf, ttt.StepTime(*own))])


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
        row = {"method": method, "lr": lr, "run": str(path), "params": last["params"],
               "val_ppl": last["val_ppl"], "test_ppl": last["test_ppl"],
               "mb_per_step": last["comm_bytes_per_step"] / 1e6,
               "steps_to_target": steps_to(_curve(path), target),
               "step_s": {link: _spread(r) for link, r in mine.items()}}
        before = {link: _spread(times.get((FULL_PHASE.get(method, method), link)))
                  for link in links}
        row["seconds_to_target"] = {link: None if (t := seconds_to(row, before[link], link))
                                    is None else t.median for link in links}
        rows.append(row)
    return {"target": target, "ddp_val_ppl": ddp_last["val_ppl"], "links": links, "rows": rows}


def first(found: dict, link: str) -> str | None:
    """The method that reaches the target soonest over ``link`` (None: none does)."""
    timed = {r["method"]: r["seconds_to_target"][link] for r in found["rows"]
             if r.get("seconds_to_target", {}).get(link) is not None}
    return min(timed, key=timed.__getitem__) if timed else None


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
    lines += ["", "First to the target: " + ", ".join(
        f"{link} {first(found, link) or 'none'}" for link in links) + "."]
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
        cmd = [sys.executable, "-m", "pufferfish", "bench", *BENCH, "--methods",
               ",".join(LINK_METHODS), "--bandwidth", args.bandwidth,
               "--out", str(args.out / "links" / "bench")]
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)
    text = table(args.out)
    print(text)
    if args.md is not None:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
