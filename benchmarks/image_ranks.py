"""Each image baseline at its best: PowerSGD's rank, Pufferfish's rank ratio and the compositions.

ResNet-18 width 0.25 on Fashion-MNIST's 60,000 training images (5,000 held out for validation,
choices made there), 20 epochs, 2 processes x 64 images, the paper's SGD recipe (LR 0.1, steps at
50% and 75%), seeds 0 and 1, every method's seed 0 before any seed 1:

- DDP (full rank, plain all-reduce): the reference and its targets, DDP - 0.5 and DDP - 1 points
  of mean test accuracy (docs/benchmarks.md, "Each baseline at its best", fixed before the runs);
- PowerSGD at ranks 1, 2, 4, 8 (torch's advice: an exponential grid from 1), compression from
  step 860, 10% of the 8,600 steps (torch's advice for ``start_powerSGD_iter``);
- Pufferfish at rank ratios 1/8, 1/4, 1/2 (2-epoch full-rank warm-up, the paper's);
- Pufferfish (1/4) + fp16, and Pufferfish (1/4) + PowerSGD at PowerSGD's best rank: the lowest
  rank whose mean validation accuracy is within 0.5 points of DDP's, else the most accurate
  (queued as soon as that rank is settled: DDP's and the ranks up to it have both seeds).

    python benchmarks/image_ranks.py run OUT [--dry-run]
    sudo python benchmarks/image_ranks.py bench OUT --seed S   # once the runs have finished
    python benchmarks/image_ranks.py table OUT [--md FILE]
    python benchmarks/image_ranks.py cache OUT DEST   # the runs' records and the benches, no checkpoints
    python benchmarks/image_ranks.py settings OUT   # the picks to DDP − 0.5, as bench flags (the demo's)

On a fresh machine, start OUT from the cache (``cp -r CACHE/. OUT``): its runs count as
finished and ``cache`` skips them again. Runs go through ``benchmarks/sweep.py`` (cached,
resumed from checkpoints); 20 to 55 minutes a run on 2 idle CPU cores, 20 runs in all. ``bench`` times every method's settings side by side in
one ``pufferfish bench`` (each setting a ``METHOD:KEY=VALUE`` method), once per seed, so that
each seed's times come from rounds of their own. ``table``: each run's epochs to each target and
its seconds over each link, a run's steps timed in phases (:func:`phases`); the verdict per
target and seed, over 100 Mbit/s: the fastest Pufferfish variant against the fastest PowerSGD
rank, each side's fastest chosen on validation (time to DDP's mean final validation accuracy
minus the same margin), judged on test by worst rounds.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import sweep  # benchmarks/ is not a package: its folder on the path

from pufferfish.bench import time_to_target as ttt

BASE = ("--config", "resnet18_fashion", "--width", "0.25", "--batch-size", "64", "--epochs", "20",
        "--warmup-epochs", "2", "--threads", "1", "--no-progress", "--checkpoint-every-epochs", "1")
START_ITER = 860  # 10% of 20 epochs x 429 steps (55,000 images / 128 a step), rounded up
PSGD_RANKS = (1, 2, 4, 8)
RATIOS = ("0.125", "0.25", "0.5")
SEEDS = (0, 1)
PSGD = ("--comm", "powersgd", "--powersgd-start-iter", str(START_ITER))
METHODS: dict[str, tuple[str, ...]] = {
    "ddp": ("--mode", "full"),
    **{f"psgd-r{r}": ("--mode", "full", *PSGD, "--powersgd-rank", str(r)) for r in PSGD_RANKS},
    **{f"puff-r{x}": ("--mode", "pufferfish", "--rank-ratio", x) for x in RATIOS},
    "puff-fp16": ("--mode", "pufferfish", "--rank-ratio", "0.25", "--comm", "fp16"),
}


FRACTIONS = {"0.125": "⅛", "0.25": "¼", "0.5": "½"}


def label(method: str, path: Path) -> str:
    """What a run trained, in words: "PowerSGD rank 2", "Pufferfish (rank ¼) + fp16"."""
    if method == "ddp":
        return "DDP"
    if method.startswith("psgd-r"):
        return f"PowerSGD rank {method[6:]}"
    if method.startswith("puff-r"):
        return f"Pufferfish (rank {FRACTIONS[method[6:]]})"
    puff = f"Pufferfish (rank {FRACTIONS[RATIO]})"  # the compositions' ratio
    return f"{puff} + fp16" if method == "puff-fp16" else \
        f"{puff} + PowerSGD rank {_config_rank(path)}"


TOTAL_RUNS = (len(METHODS) + 1) * len(SEEDS)  # every method's and the composition with PowerSGD's


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / f"{method}-s{seed}"


def mean_val(out: Path, method: str) -> float | None:
    """Mean final validation accuracy over the seeds; None until every seed has finished."""
    rows = [sweep.finished(run_dir(out, method, s)) for s in SEEDS]
    if any(r is None or "val_acc" not in r for r in rows):
        return None
    return sum(r["val_acc"] for r in rows) / len(rows)  # type: ignore[index]


def best_psgd_rank(out: Path) -> int | None:
    """The lowest PowerSGD rank within 0.5 points of DDP's mean validation accuracy, else the most
    accurate rank; None until that is settled: known as soon as DDP and the ranks up to the
    chosen one have all their seeds (the rank grid's later seeds cannot change a lower pick)."""
    ddp = mean_val(out, "ddp")
    if ddp is None:
        return None
    vals: dict[int, float] = {}
    for rank in PSGD_RANKS:
        if (val := mean_val(out, f"psgd-r{rank}")) is None:
            return None
        if val >= ddp - 0.005:
            return rank
        vals[rank] = val
    return max(vals, key=vals.__getitem__)


def runs(out: Path) -> list[sweep.Run]:
    """Every run of the study known so far, in trial order."""
    methods = dict(METHODS)
    if (rank := best_psgd_rank(out)) is not None:
        methods["puff-psgd"] = ("--mode", "pufferfish", "--rank-ratio", "0.25", *PSGD,
                                "--powersgd-rank", str(rank))
    return [sweep.Run(run_dir(out, m, s), (*BASE, *flags, "--seed", str(s)))
            for s in SEEDS for m, flags in methods.items()]


def pending(out: Path) -> list[str]:
    """The study's runs not finished yet, by name (the composition's too, before its rank is
    chosen)."""
    todo = [r.path.name for r in runs(out) if sweep.finished(r.path) is None]
    if best_psgd_rank(out) is None:
        todo += [run_dir(out, "puff-psgd", s).name for s in SEEDS]
    return todo


def cache(out: Path, dest: Path) -> list[Path]:
    """Copy the study's finished runs (their records, not their checkpoints) and its benches'
    results into the cache folder ``dest``; returns what was copied."""
    copies = sweep.cache([r.path for r in runs(out)], dest)
    for seed in SEEDS:
        for name in ("results.json", "results.md"):
            src = bench_dir(out, seed) / name
            if src.is_file():
                sweep.copy_once(src, dest / src.parent.name / name)
                copies.append(dest / src.parent.name / name)
    return copies


# -- timing: the bench's step times per seed, each run's steps in phases ------------------------

BENCH = ("--model", "resnet18", "--width", "0.25", "--batch-size", "64", "--threads", "1",
         "--rounds", "3")
LINKS = "loopback,1gbit,100mbit"
VERDICT_LINK = "100mbit"
MARGINS = (0.5, 1.0)  # the targets: DDP's mean final accuracy minus these points
RATIO = "0.25"  # the compositions' rank ratio
SIDES = {"Pufferfish": "puff", "PowerSGD": "psgd"}  # the verdict's sides: their runs' prefixes


def bench_methods(rank: int) -> list[str]:
    """Every step time a run's phases need (:func:`phases`), PowerSGD's best rank ``rank`` in
    the composition; each setting a ``METHOD:KEY=VALUE`` bench method."""
    return ["ddp", "fp16", *(f"powersgd:rank={r}" for r in PSGD_RANKS),
            *(f"pufferfish:rank_ratio={x}" for x in RATIOS), f"pufferfish+fp16:rank_ratio={RATIO}",
            f"pufferfish+powersgd:rank_ratio={RATIO}:rank={rank}"]


def bench_dir(out: Path, seed: int) -> Path:
    return out / f"bench-s{seed}"


def switch_step(path: Path) -> int:
    """The optimizer step a Pufferfish run switched at (its warm-up epochs' steps), 0 if none."""
    report = path / "factorization.json"
    if not report.is_file():
        return 0
    record = json.loads(report.read_text())
    if "step" in record:  # a switch in optimizer steps
        return int(record["step"])
    return sum(r["steps"] for r in _rows(path)[:record["epoch"]])  # before epoch N (from 0)


def phases(method: str, path: Path) -> list[tuple[float, str]]:
    """A run's steps as ``(steps, bench method)`` in order, the last unbounded: PowerSGD
    all-reduces plainly (DDP's step) for its first ``START_ITER`` steps; a Pufferfish run steps
    at its full-rank counterpart's time until its switch; with PowerSGD, whose hook starts again
    on the factorized model (``distributed.env.rewrap_ddp``), plainly for ``START_ITER`` more."""
    if method == "ddp":
        return [(math.inf, "ddp")]
    if method.startswith("psgd-r"):
        return [(START_ITER, "ddp"), (math.inf, f"powersgd:rank={method[6:]}")]
    switch = switch_step(path)
    if method.startswith("puff-r"):
        return [(switch, "ddp"), (math.inf, f"pufferfish:rank_ratio={method[6:]}")]
    if method == "puff-fp16":
        return [(switch, "fp16"), (math.inf, f"pufferfish+fp16:rank_ratio={RATIO}")]
    rank = _config_rank(path)
    plain = min(switch, START_ITER)
    return [(plain, "ddp"), (switch - plain, f"powersgd:rank={rank}"),
            (START_ITER, f"pufferfish:rank_ratio={RATIO}"),
            (math.inf, f"pufferfish+powersgd:rank_ratio={RATIO}:rank={rank}")]


def _config_rank(path: Path) -> int:
    return int(tomllib.loads((path / "config.toml").read_text())["powersgd_rank"])


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def steps_to(path: Path, target: float, split: str) -> float | None:
    """The optimizer steps until the end of the first epoch whose ``split`` accuracy
    (``val`` or ``test``) reaches ``target`` (None: never)."""
    rows, done = _rows(path), 0.0
    for row in rows:
        done += row["steps"]
        if row.get(f"{split}_acc", -1.0) >= target:
            return done
    return None


def step_times(out: Path, seed: int) -> dict[tuple[str, str], ttt.StepTime] | None:
    """(bench method, link) -> its step time over the rounds of seed ``seed``'s bench."""
    results = bench_dir(out, seed) / "results.json"
    if not results.is_file():
        return None
    return {(r["method"], r["bandwidth"]): ttt.StepTime(r["step_time"], *r["spread"]["step_time"])
            for r in json.loads(results.read_text())["rows"]}


def _timed_phases(method: str, path: Path, link: str, times: dict[tuple[str, str], ttt.StepTime]
                  ) -> list[tuple[float, ttt.StepTime]] | None:
    """A run's phases at their step times over ``link``; None when one was not measured."""
    parts = [(n, m) for n, m in phases(method, path) if n > 0]
    if any((m, link) not in times for _, m in parts):
        return None
    return [(n, times[(m, link)]) for n, m in parts]


def seconds_to(method: str, path: Path, steps: float | None, link: str,
               times: dict[tuple[str, str], ttt.StepTime]) -> ttt.StepTime | None:
    """A run's seconds for its first ``steps`` over ``link`` (median, best round, worst round);
    None when it never reaches the target (``steps`` None) or a phase's time was not measured."""
    timed = _timed_phases(method, path, link, times)
    return None if steps is None or timed is None else ttt.time_range(steps, timed)


def curve(method: str, path: Path, link: str, times: dict[tuple[str, str], ttt.StepTime]
          ) -> list[tuple[ttt.StepTime, float]] | None:
    """A run's modelled seconds over ``link`` at the end of each epoch, with its test accuracy
    then (the plot's points); None when a phase's step time was not measured."""
    timed = _timed_phases(method, path, link, times)
    if timed is None:
        return None
    rows = _rows(path)
    ends = itertools.accumulate(row["steps"] for row in rows)
    return [(ttt.time_range(end, timed), row["test_acc"]) for end, row in zip(ends, rows)
            if "test_acc" in row]


def targets(out: Path) -> dict[str, float] | None:
    """DDP's mean final accuracy over its seeds, validation and test; None until both ran."""
    rows = [sweep.finished(run_dir(out, "ddp", s)) for s in SEEDS]
    if any(r is None for r in rows):
        return None
    return {split: sum(r[f"{split}_acc"] for r in rows) / len(rows)  # type: ignore[index]
            for split in ("val", "test")}


def _unmeasured(out: Path, seed: int, times: dict, links: list[str]) -> str | None:
    """What seed ``seed``'s bench lacks that its finished runs' phases need (the verdict's link,
    a setting's step time over a link), said as what to run; None when it has all."""
    missing = [] if VERDICT_LINK in links else [f"the {VERDICT_LINK} link"]
    for method in (*METHODS, "puff-psgd"):
        path = run_dir(out, method, seed)
        if sweep.finished(path) is not None:
            missing += [f"{m} over {link}" for _, m in phases(method, path) for link in links
                        if (m, link) not in times]
    missing = list(dict.fromkeys(missing))
    return None if not missing else (
        f"image_ranks: seed {seed}'s bench lacks {', '.join(missing)} (sudo image_ranks.py bench "
        f"OUT --seed {seed} again)")


def results(out: Path) -> dict | str:
    """Every finished run's epochs to each target and seconds over each link, per seed, from its
    seed's bench; a string says what is missing."""
    ddp = targets(out)
    if ddp is None:
        return "image_ranks: DDP's two seeds have not finished"
    methods = [*METHODS, "puff-psgd"]
    found: dict = {"ddp": ddp, "rows": []}
    links: list[str] | None = None
    for seed in SEEDS:
        times = step_times(out, seed)
        if times is None:
            return f"image_ranks: no bench for seed {seed} yet (sudo image_ranks.py bench OUT " \
                   f"--seed {seed})"
        seen = list(dict.fromkeys(link for _, link in times))
        links = seen if links is None else [link for link in links if link in seen]  # in every bench
        if (lacks := _unmeasured(out, seed, times, links)) is not None:
            return lacks
        for method in methods:
            path = run_dir(out, method, seed)
            if sweep.finished(path) is None:
                continue
            row = {"method": method, "seed": seed, "final": sweep.finished(path), "to": {}}
            for margin in MARGINS:
                for split in ("val", "test"):
                    steps = steps_to(path, ddp[split] - margin / 100, split)
                    row["to"][(margin, split)] = {
                        "steps": steps, **{link: seconds_to(method, path, steps, link, times)
                                           for link in links}}
            found["rows"].append(row)
        found["links"] = links
    return found


def fastest(found: dict, prefix: str, margin: float) -> str | None:
    """Of the study's methods starting with ``prefix``, the one with the lowest mean median
    seconds to the validation target over ``VERDICT_LINK`` on both seeds (None: none reaches
    it on both): each side's choice is made on validation."""
    mean: dict[str, float] = {}
    for method in sorted({r["method"] for r in found["rows"] if r["method"].startswith(prefix)}):
        times = [r["to"][(margin, "val")][VERDICT_LINK] for r in found["rows"]
                 if r["method"] == method]
        if len(times) == len(SEEDS) and None not in times:
            mean[method] = sum(t.median for t in times) / len(times)
    return min(mean, key=mean.__getitem__) if mean else None  # a tie: the first by name


def judge(found: dict, margin: float, seed: int) -> dict:
    """Over ``VERDICT_LINK`` to DDP − ``margin`` on test, seed ``seed``: each side's fastest
    (``picks``, chosen on validation: :func:`fastest`), its test time (``times``, None: never)
    and the ``answer``, by worst rounds: a side is first only when its worst round is faster
    than the other's best."""
    picks = {side: fastest(found, prefix, margin) for side, prefix in SIDES.items()}
    times = {side: None if m is None else next(
        r["to"][(margin, "test")][VERDICT_LINK] for r in found["rows"]
        if r["method"] == m and r["seed"] == seed) for side, m in picks.items()}
    puff, psgd = times["Pufferfish"], times["PowerSGD"]
    if puff is not None and (psgd is None or puff.high < psgd.low):
        answer = "Pufferfish first"
    elif psgd is not None and (puff is None or psgd.high < puff.low):
        answer = "PowerSGD first"
    else:
        answer = "a tie (the rounds overlap)" if puff is not None else "neither reaches it"
    return {"picks": picks, "times": times, "answer": answer}


def verdict(found: dict, margin: float, seed: int) -> str:
    """:func:`judge`'s answer in one line, each side's pick and its time [best–worst round]."""
    j = judge(found, margin, seed)
    shown = "; ".join(f"{side} {j['picks'][side] or '(none reaches it on validation)'}: "
                      + ("never" if t is None else f"{t.median:,.0f} s [{t.low:,.0f}–{t.high:,.0f}]")
                      for side, t in j["times"].items())
    return f"DDP −{margin:g}, seed {seed}: {shown}: {j['answer']}"


def finals(out: Path) -> str:
    """Every finished run's final validation and test accuracy: the study so far."""
    lines = ["| run | what | final validation | final test |", "|---|---|---|---|"]
    for r in runs(out):
        if (last := sweep.finished(r.path)) is not None:
            method = r.path.name.rsplit("-s", 1)[0]
            lines.append(f"| {r.path.name} | {label(method, r.path)} | "
                         f"{100 * last['val_acc']:.2f}% | {100 * last['test_acc']:.2f}% |")
    return "\n".join(lines) + "\n"


def table(out: Path) -> str:
    """Each run's epochs and seconds to each target (test) over each link, and the verdicts."""
    found = results(out)
    if isinstance(found, str):
        return finals(out) + "\n" + found + "\n"
    links = found["links"]
    lines = [f"Targets: DDP's mean final test accuracy {100 * found['ddp']['test']:.2f}% "
             f"(validation {100 * found['ddp']['val']:.2f}%) minus "
             + " and ".join(f"{m:g}" for m in MARGINS) + " points.", ""]
    for margin in MARGINS:
        lines += [f"To DDP −{margin:g} (test):", "",
                  "| method | seed | final test | steps | "
                  + " | ".join(f"seconds, {link}" for link in links) + " |",
                  "|---|---|---|---|" + "---|" * len(links)]
        for r in found["rows"]:
            to = r["to"][(margin, "test")]
            cells = ["never" if to["steps"] is None else "–" if to[link] is None else
                     f"{to[link].median:,.0f} [{to[link].low:,.0f}–{to[link].high:,.0f}]"
                     for link in links]
            steps = "–" if to["steps"] is None else f"{to['steps']:,.0f}"
            lines.append(f"| {r['method']} | {r['seed']} | {100 * r['final']['test_acc']:.2f}% "
                         f"| {steps} | " + " | ".join(cells) + " |")
        lines += ["", *(verdict(found, margin, seed) for seed in SEEDS), ""]
    return "\n".join(lines).rstrip() + "\n"


def settings(out: Path, margin: float = 0.5) -> dict | str:
    """The sweep's picks to DDP − ``margin`` (chosen on validation, :func:`fastest`): the
    fastest PowerSGD rank and the fastest Pufferfish rank ratio alone, as ``{"powersgd_rank":
    r, "rank_ratio": "x"}`` (what `make demo` trains at); a string says why there are none."""
    found = results(out)
    if isinstance(found, str):
        return found
    psgd, puff = fastest(found, "psgd-r", margin), fastest(found, "puff-r", margin)
    if psgd is None or puff is None:
        return f"image_ranks: no {'PowerSGD rank' if psgd is None else 'Pufferfish rank ratio'} " \
               f"reaches DDP −{margin:g} on validation on both seeds"
    return {"powersgd_rank": int(psgd.removeprefix("psgd-r")),
            "rank_ratio": puff.removeprefix("puff-r")}


def bench(out: Path, seed: int) -> int:
    """``pufferfish bench`` of every setting the runs' phases need, for seed ``seed``'s times."""
    rank = best_psgd_rank(out)
    if rank is None:
        print("image_ranks: PowerSGD's best rank is not chosen yet (image_ranks.py run OUT "
              "first)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pufferfish", "bench", *BENCH,
           "--methods", ",".join(bench_methods(rank)), "--bandwidth", LINKS,
           # --overwrite: asked again, the seed's bench re-measures (e.g. at a new best rank)
           "--out", str(bench_dir(out, seed)), "--overwrite"]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main() -> int:
    parser, sub = sweep.parser(__doc__)
    b = sub.add_parser("bench")
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, choices=SEEDS, required=True)
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    t.add_argument("--md", type=Path)
    p = sub.add_parser("settings", help="the picks to DDP − 0.5 as `pufferfish bench` flags")
    p.add_argument("out", type=Path)
    c = sub.add_parser("cache", help="copy the finished runs and the benches into a cache folder")
    c.add_argument("out", type=Path)
    c.add_argument("dest", type=Path)
    args = parser.parse_args()
    if args.cmd == "cache":
        copied = cache(args.out, args.dest)
        print(f"image_ranks: {len(copied)} cached in {args.dest}; still to run: "
              + (", ".join(pending(args.out)) or "none"))
        return 0
    if args.cmd == "settings":
        picked = settings(args.out)
        if isinstance(picked, str):
            print(picked, file=sys.stderr)
            return 1
        print(f"--powersgd-rank {picked['powersgd_rank']} --rank-ratio {picked['rank_ratio']}")
        return 0
    if args.cmd == "bench":
        return bench(args.out, args.seed)
    if args.cmd == "table":
        text = table(args.out)
        print(text, end="")
        if args.md is not None:
            args.md.write_text(text)
        return 0
    if args.dry_run:
        sweep.run_all(runs(args.out), dry_run=True)
        return 0
    # the queue read again after every run: the composition joins it (in its seed's place) as
    # soon as PowerSGD's best rank is settled
    failed: set[Path] = set()  # each log says why; run again to resume them
    while todo := [r for r in runs(args.out)
                   if sweep.finished(r.path) is None and r.path not in failed]:
        if not sweep.train(todo[0]):
            failed.add(todo[0].path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
