"""The language-model budget study: does Pufferfish's full-rank warm-up matter at N tokens/param?

llama width 0.125 (dim 64, 8 layers, 0.56M parameters at vocabulary 1,024) on ``kjv+gcide``,
2 processes x 64 sequences x 128 tokens = 16,384 tokens per step, AdamW with the LM recipe (10%
LR warm-up, cosine, weight decay 0.1, clip 1.0); validation every 100 steps (for choosing), test
once at the end (for reporting), both on the first 262,144 tokens of their splits; a checkpoint
every 100 steps, so a stopped study resumes where it was.

    python benchmarks/lm_budget.py run OUT [--phase lr|variants|seeds|width] [--methods a,b] [--dry-run]
    python benchmarks/lm_budget.py summary OUT [--md FILE] [--png FILE]
    python benchmarks/lm_budget.py lag OUT --lr LR [--reference lowrank]

``run`` works through a queue and keeps every finished run (a run directory whose last metrics
row has ``test_ppl``), so the study grows across sessions: phase ``lr`` is each method at each LR
of its grid at 20 tokens per parameter, seed 0, in an order that gives every method one LR before
any gets a second, a grid growing past its edge while its best is there (run it again after the
runs to take the new points); phase ``variants`` is each candidate against the switch's cost
(``VARIANTS``) once, at its base method's chosen LR; phase ``seeds`` is seeds 0-2 at 1, 5 and 20 tokens per parameter at each
method's LR chosen on validation by phase ``lr`` (for Pufferfish the method or variant with the
best validation at 20 tokens per parameter). ``summary`` prints the tables, the LR chosen per
method, the decision rule's verdict per budget, and plots test perplexity against tokens per
parameter. Phase ``width`` repeats the comparison at width 0.25 (``OUT/w0.25/``; its queue and
decision rule: ``benchmarks/lm_width.py``).

The decision rule, fixed before the runs: at a budget, the warm-up matters when full rank beats
low rank from the start by more than twice the larger seed spread (max - min over 3 seeds), and
Pufferfish recovers at least half of that gap (its mean is at most halfway from full rank's to
low rank's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import sweep  # benchmarks/ is not a package: its folder on the path
from sweep import finished

WIDTH = 0.125  # the study's width; phase ``width`` runs WIDE too
WIDE = 0.25
BASE = ["--model", "llama", "--data", "kjv+gcide", "--seq-len", "128",
        "--vocab-size", "1024", "--batch-size", "64", "--eval-every-steps", "100",
        "--test-subset", "262144", "--bucket-mb", "torch", "--threads", "1", "--no-progress",
        "--epochs", "4", "--checkpoint-every-steps", "100"]
# name -> (flags, LR grid): the same number of trials for every method
METHODS: dict[str, tuple[list[str], list[float]]] = {
    "full": (["--mode", "full"], [3e-3, 1e-2, 1e-3]),
    "lowrank": (["--mode", "lowrank"], [3e-3, 1e-2, 1e-3]),
    "puff10proj": (["--mode", "pufferfish", "--warmup-steps", "0.10",
                    "--switch-momentum", "project"], [3e-3, 1e-2, 1e-3]),
    "galore": (["--mode", "galore", "--galore-scale", "0.25"], [1e-2, 3e-2, 3e-3]),
}
# phase ``width``'s Pufferfish (benchmarks/lm_width.py): the default switch (10% of the steps,
# the optimizer as auto carries it); its LR is full rank's better one at that width
WIDE_PUFF = {"puff10auto": ["--mode", "pufferfish", "--warmup-steps", "0.10"]}
# Pufferfish's other settings, each tried once at puff10proj's chosen LR (on validation): the
# switch point, Adam's moments reset or projected, and candidates against the switch's cost.
# name -> (flags, base method whose LR it takes). First in the queue, first run.
PUFF = ["--mode", "pufferfish", "--switch-momentum"]
VARIANTS: dict[str, tuple[list[str], str]] = {
    "puff2proj": ([*PUFF, "project", "--warmup-steps", "0.02"], "puff10proj"),
    "puff25proj": ([*PUFF, "project", "--warmup-steps", "0.25"], "puff10proj"),
    "puff10proj-rw5": ([*PUFF, "project", "--warmup-steps", "0.10", "--switch-lr-warmup", "0.05"],
                       "puff10proj"),
    "puff1step": ([*PUFF, "project", "--warmup-steps", "1"], "puff10proj"),
    "puff2reset": ([*PUFF, "reset", "--warmup-steps", "0.02"], "puff10proj"),
    "puff10reset-rw5": ([*PUFF, "reset", "--warmup-steps", "0.10", "--switch-lr-warmup", "0.05"],
                        "puff10proj"),  # ReLoRA's own pairing: fresh moments, LR ramped again
    "puff50proj": ([*PUFF, "project", "--warmup-steps", "0.50"], "puff10proj"),
    "puff10reset": ([*PUFF, "reset", "--warmup-steps", "0.10"], "puff10proj"),
    "puff25reset": ([*PUFF, "reset", "--warmup-steps", "0.25"], "puff10proj"),
    # ReLoRA's pairing at the other switch points (the rule `--switch-momentum auto` is built on)
    "puff25reset-rw5": ([*PUFF, "reset", "--warmup-steps", "0.25", "--switch-lr-warmup", "0.05"],
                        "puff10proj"),
    "puff2reset-rw5": ([*PUFF, "reset", "--warmup-steps", "0.02", "--switch-lr-warmup", "0.05"],
                       "puff10proj"),
}
LR_BUDGET, BUDGETS, SEEDS = 20.0, (1.0, 5.0, 20.0), (0, 1, 2)
LADDER = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]  # where a grid grows past its edge


def run_dir(out: Path, budget: float, method: str, lr: float, seed: int,
            width: float = WIDTH) -> Path:
    root = out if width == WIDTH else out / f"w{width:g}"
    return root / f"tpp{budget:g}" / f"{method}-lr{lr:g}-s{seed}"


def best_val(path: Path) -> float | None:
    """The run's final validation perplexity (what the LR is chosen on)."""
    last = finished(path)
    return None if last is None else last["val_ppl"]


def grow(base: list[float], val_of: Callable[[float], float | None]) -> list[float]:
    """The LRs to try: ``base``, grown one half-decade step (``LADDER``) past an edge for as
    long as the best final validation perplexity so far (``val_of``) sits on that edge, the same
    rule for every method (an LR at the grid's edge is not chosen, only bounded)."""
    lrs = sorted(base)
    while True:
        vals = {lr: val_of(lr) for lr in lrs}
        if any(v is None for v in vals.values()):
            return lrs
        best = min(vals, key=lambda lr: vals[lr])  # type: ignore[arg-type,return-value]
        i = LADDER.index(best)
        step = 1 if best == lrs[-1] else -1 if best == lrs[0] else 0
        if step == 0 or not 0 <= i + step < len(LADDER):
            return lrs
        lrs = sorted([*lrs, LADDER[i + step]])


def pick(base: list[float], val_of: Callable[[float], float | None]) -> float | None:
    """The LR of :func:`grow`'s grid with the lowest final validation perplexity; None until
    every LR of the grid has finished."""
    vals = {lr: val_of(lr) for lr in grow(base, val_of)}
    if any(v is None for v in vals.values()):
        return None
    return min(vals, key=lambda lr: vals[lr])  # type: ignore[arg-type,return-value]


def interleaved(grids: dict[str, list[float]]) -> list[tuple[str, float]]:
    """(method, LR) in trial order: every method's first LR before any method's second."""
    return [(m, lrs[i]) for i in range(max(map(len, grids.values()), default=0))
            for m, lrs in grids.items() if i < len(lrs)]


def trial_order(base: list[float], val_of: Callable[[float], float | None]) -> list[float]:
    """:func:`grow`'s grid, ``base`` in its own order first, then the LRs it grew."""
    return [*base, *(lr for lr in grow(base, val_of) if lr not in base)]


def _seed0_val(out: Path, method: str) -> Callable[[float], float | None]:
    return lambda lr: best_val(run_dir(out, LR_BUDGET, method, lr, 0))


def grid(out: Path, method: str) -> list[float]:
    """``method``'s LRs to try at 20 tokens per parameter, seed 0 (:func:`grow`)."""
    return grow(METHODS[method][1], _seed0_val(out, method))


def chosen_lr(out: Path, method: str) -> float | None:
    """The LR of ``method``'s grid (:func:`grid`) with the lowest final validation perplexity at
    20 tokens per parameter, seed 0 (a variant: its base method's); None until the grid has run."""
    if method in VARIANTS:
        return chosen_lr(out, VARIANTS[method][1])
    return pick(METHODS[method][1], _seed0_val(out, method))


def best_pufferfish(out: Path) -> str | None:
    """The Pufferfish method or variant with the lowest final validation perplexity at 20 tokens
    per parameter, seed 0, at its chosen LR (what the seeds phase runs for Pufferfish)."""
    vals = {}
    for m in [*METHODS, *VARIANTS]:
        lr = chosen_lr(out, m) if m.startswith("puff") else None
        val = None if lr is None else best_val(run_dir(out, LR_BUDGET, m, lr, 0))
        if val is not None:
            vals[m] = val
    return min(vals, key=vals.__getitem__) if vals else None


def queue(out: Path, phase: str, methods: list[str],
          budgets: tuple[float, ...] = BUDGETS) -> list[tuple[float, str, float, int]]:
    """(budget, method, lr, seed) still to run, in order (seeds: at ``budgets`` only)."""
    if phase == "variants":
        todo = [(LR_BUDGET, m, lr, 0) for m in methods if (lr := chosen_lr(out, m)) is not None]
    elif phase == "lr":
        grids = {m: trial_order(METHODS[m][1], _seed0_val(out, m)) for m in methods}
        todo = [(LR_BUDGET, m, lr, 0) for m, lr in interleaved(grids)]
    else:
        todo = []
        for seed in SEEDS:
            for budget in sorted(budgets, reverse=True):
                for name in methods:
                    m = best_pufferfish(out) if name == "pufferfish" else name
                    if m is None:  # no Pufferfish setting has finished at 20 yet
                        continue
                    lr = chosen_lr(out, m)
                    if lr is not None:
                        todo.append((budget, m, lr, seed))
    return [t for t in todo if finished(run_dir(out, *t)) is None]


def flags(method: str) -> list[str]:
    if method in WIDE_PUFF:
        return WIDE_PUFF[method]
    return VARIANTS[method][0] if method in VARIANTS else METHODS[method][0]


def launch(out: Path, budget: float, method: str, lr: float, seed: int,
           width: float = WIDTH) -> bool:
    return train(run_dir(out, budget, method, lr, seed, width), flags(method), lr, seed, budget,
                 width)


def train(path: Path, method_flags: list[str], lr: float, seed: int, budget: float,
          width: float = WIDTH) -> bool:
    """One 2-process run of the study's recipe (``BASE``) at ``width`` with ``method_flags``
    into ``path`` through the sweep runner (resumed from its newest checkpoint if it has one);
    True when it finished."""
    return sweep.train(sweep.Run(path, (*BASE, "--width", f"{width:g}", *method_flags, "--lr",
                                        f"{lr:g}", "--seed", str(seed), "--tokens-per-param",
                                        f"{budget:g}")))


def table(out: Path) -> list[dict]:
    rows = []
    for budget_dir in sorted(out.glob("tpp*")):
        for path in sorted(budget_dir.iterdir()):
            last = finished(path) if path.is_dir() else None
            if last is None:
                continue
            method, lr, seed = path.name.rsplit("-", 2)
            rows.append({"budget": float(budget_dir.name[3:]), "method": method,
                         "lr": float(lr[2:]), "seed": int(seed[1:]), "val_ppl": last["val_ppl"],
                         "test_ppl": last["test_ppl"], "params": last["params"],
                         "time_s": sum(json.loads(r)["epoch_time"] for r in
                                       (path / "metrics.jsonl").read_text().splitlines() if r)})
    return rows


def verdicts(out: Path, rows: list[dict]) -> list[dict]:
    """The decision rule at each budget: ``{"budget", "text", "matters"}``, ``matters`` None until
    full rank and low rank from the start have all seeds at their chosen LRs. Pufferfish is the
    variant chosen on validation (:func:`best_pufferfish`), shown with the seeds it has so far and
    judged with all; when full rank does not clearly beat low rank there is no gap to recover: no."""
    out_rows = []
    puff = best_pufferfish(out)
    for budget in BUDGETS:
        stats = {}
        for m in ("full", "lowrank", *([puff] if puff else [])):
            lr = chosen_lr(out, m)
            vals = [r["test_ppl"] for r in rows if r["method"] == m and r["budget"] == budget
                    and r["lr"] == lr]
            if vals:
                stats[m] = (sum(vals) / len(vals), max(vals) - min(vals), len(vals))
        if any(stats.get(m, (0, 0, 0))[2] < len(SEEDS) for m in ("full", "lowrank")):
            out_rows.append({"budget": budget, "matters": None,
                             "text": f"{budget:g} tokens/param: not enough seeds yet"})
            continue
        (f_mean, f_spread, _), (l_mean, l_spread, _) = stats["full"], stats["lowrank"]
        gap, bar = l_mean - f_mean, 2 * max(f_spread, l_spread)
        text = (f"{budget:g} tokens/param: full {f_mean:.2f}, lowrank {l_mean:.2f} (gap "
                f"{gap:+.2f}, 2x spread {bar:.2f}): full rank "
                + ("beats low rank from the start" if gap > bar else
                   "is beaten by low rank from the start" if -gap > bar else
                   "does not clearly beat low rank from the start"))
        matters: bool | None = False
        if gap > bar:
            if puff in stats:
                mean, _, n = stats[puff]
                recovered = (l_mean - mean) / gap
                text += (f"; Pufferfish ({puff}, {n} of {len(SEEDS)} seeds) {mean:.2f} recovers "
                         f"{recovered:.0%} of the gap")
                matters = recovered >= 0.5 if n == len(SEEDS) else None
            else:
                text, matters = text + "; Pufferfish not run yet", None
        verdict = {True: "the warm-up matters", False: "the warm-up does not matter",
                   None: "no verdict yet"}[matters]
        out_rows.append({"budget": budget, "matters": matters, "text": f"{text}: {verdict}"})
    return out_rows


def lag(out: Path, lr: float, reference: str = "lowrank") -> str:
    """Each method's distance behind ``reference`` (same LR, 20 tokens per parameter, seed 0) in
    LR-integrated time: at each evaluation, the schedule's summed LR (in peak-LR steps) minus
    the summed LR at which ``reference``'s validation curve (log-linear between evaluations)
    reached the same perplexity (from the vocabulary's size, a uniform guess, at step 0). A
    constant lag means "as fast per unit of LR, started behind";
    a growing one, "learns more slowly". The re-warm-up's own ramp is not in the sum."""
    from pufferfish.training.schedule import lr_at
    from pufferfish.training.startup import load_run_config

    def curve(path: Path, start: float) -> list[tuple[int, float]]:
        rows = [json.loads(r) for r in (path / "evals.jsonl").read_text().splitlines() if r]
        last = finished(path) or {}
        return [(0, start), *((r["step"], r["val_ppl"]) for r in rows),
                (last["steps"], last["val_ppl"])]

    def reached(points: list[tuple[int, float]], tau: list[float], ppl: float) -> float | None:
        for (s0, p0), (s1, p1) in itertools.pairwise(points):
            if p0 >= ppl >= p1 and p0 > p1:
                f = (math.log(p0) - math.log(ppl)) / (math.log(p0) - math.log(p1))
                return tau[s0] + f * (tau[s1] - tau[s0])
        return None

    ref_path = run_dir(out, LR_BUDGET, reference, lr, 0)
    if finished(ref_path) is None:
        return f"{reference} at lr {lr:g} has not finished"
    cfg = load_run_config(ref_path / "config.toml")
    steps = finished(ref_path)["steps"]
    tau = [0.0]
    for step in range(steps):
        tau.append(tau[-1] + lr_at(cfg, step, steps) / cfg.lr)
    ref = curve(ref_path, float(cfg.vocab_size))  # at step 0 about uniform: the vocabulary
    lines = [f"| method (lr {lr:g}) | " + " | ".join(f"step {s}" for s, _ in ref[1:]) + " |",
             "|---|" + "---|" * (len(ref) - 1)]
    for m in [*METHODS, *VARIANTS]:
        path = run_dir(out, LR_BUDGET, m, lr, 0)
        if m == reference or finished(path) is None:
            continue
        cells = []
        for s, ppl in curve(path, float(cfg.vocab_size))[1:]:
            at = reached(ref, tau, ppl)
            cells.append(f"{ppl:.1f} ({'-' if at is None else f'{tau[s] - at:+.0f}'})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return (f"validation perplexity (lag behind {reference} in LR-integrated steps: '-' where "
            f"{reference} never had that perplexity)\n" + "\n".join(lines))


def _against(means: dict, m: str, k: str) -> str:
    """``m``'s mean test perplexity against ``k``'s over the seeds both have (said if not all)."""
    mine, theirs = dict(means[m][1]), dict(means[k][1]) if k in means else {}
    common = sorted(set(mine) & set(theirs))
    if k == m or not common:
        return "–"
    ratio = sum(mine[s] for s in common) / sum(theirs[s] for s in common) - 1
    return f"{ratio:+.1%}" + ("" if len(common) == len(mine) == len(theirs)
                              else f" (seeds {','.join(map(str, common))})")


def seed_table(out: Path, rows: list[dict]) -> list[str]:
    """Per budget, each method at its chosen LR: seeds, mean and spread of test perplexity, and
    the mean against full rank's and low rank from the start's over the seeds both have."""
    lines = ["| tokens/param | method | lr | seeds | test ppl, each | mean | spread | vs full | "
             "vs lowrank |", "|---|---|---|---|---|---|---|---|---|"]
    for budget in sorted(BUDGETS, reverse=True):
        means = {}
        for m in [*METHODS, *VARIANTS]:
            lr = chosen_lr(out, m)
            vals = sorted((r["seed"], r["test_ppl"]) for r in rows if r["method"] == m
                          and r["budget"] == budget and r["lr"] == lr)
            if len(vals) > (budget == LR_BUDGET):  # at 20, seed 0 alone is the LR trial
                means[m] = (lr, vals)
        for m, (lr, vals) in means.items():
            mean = sum(v for _, v in vals) / len(vals)
            rel = {k: _against(means, m, k) for k in ("full", "lowrank")}
            lines.append(f"| {budget:g} | {m} | {lr:g} | {len(vals)} | "
                         + " / ".join(f"{v:.2f}" for _, v in vals)
                         + f" | {mean:.2f} | {max(v for _, v in vals) - min(v for _, v in vals):.2f}"
                         f" | {rel['full']} | {rel['lowrank']} |")
    return lines


def summary(out: Path, md: Path | None, png: Path | None) -> str:
    rows = table(out)
    text = ["| tokens/param | method | lr | seed | val ppl | test ppl | params | time (s) |",
            "|---|---|---|---|---|---|---|---|"]
    text += [f"| {r['budget']:g} | {r['method']} | {r['lr']:g} | {r['seed']} | "
             f"{r['val_ppl']:.2f} | {r['test_ppl']:.2f} | {r['params'] / 1e6:.2f}M | "
             f"{r['time_s']:.0f} |" for r in rows]
    text += ["", "LR chosen on validation (20 tokens/param, seed 0): " + ", ".join(
        f"{m} {chosen_lr(out, m) if chosen_lr(out, m) is not None else 'grid incomplete'}"
        for m in METHODS)
        + f"; Pufferfish's variant chosen on validation: {best_pufferfish(out)}", ""]
    text += [v["text"] for v in verdicts(out, rows)]
    text += ["", "Each method at its chosen LR: test perplexity over seeds", "",
             *seed_table(out, rows)]
    if png is not None and rows:
        _plot(out, rows, png)
    result = "\n".join(text)
    if md is not None:
        md.write_text(result + "\n")
    return result


def _plot(out: Path, rows: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in [*METHODS, *VARIANTS]:
        lr = chosen_lr(out, m)
        points = {}
        for r in rows:
            if r["method"] == m and r["lr"] == lr:
                points.setdefault(r["budget"], []).append(r["test_ppl"])
        if len(points) > 1:  # a setting tried at one budget only is in the tables, not here
            xs = sorted(points)
            ax.errorbar(xs, [sum(points[x]) / len(points[x]) for x in xs],
                        yerr=[(max(points[x]) - min(points[x])) / 2 for x in xs],
                        marker="o", capsize=3, label=f"{m} (lr {lr:g})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per parameter (full-rank model)")
    ax.set_ylabel("test perplexity")
    ax.set_title("llama width 0.125, kjv+gcide: mean of seeds, bars = spread")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--phase", choices=("lr", "variants", "seeds", "width"), default="lr")
    r.add_argument("--methods", help="default: lr every method, variants every variant, seeds "
                   "full, lowrank, galore and 'pufferfish' (the variant chosen on validation)")
    r.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                   help="seeds: the tokens-per-parameter budgets to run, of %(default)s")
    r.add_argument("--dry-run", action="store_true")
    s = sub.add_parser("summary")
    s.add_argument("out", type=Path)
    s.add_argument("--md", type=Path)
    s.add_argument("--png", type=Path)
    g = sub.add_parser("lag")
    g.add_argument("out", type=Path)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--reference", default="lowrank", choices=list(METHODS))
    args = parser.parse_args()
    if args.cmd == "lag":
        print(lag(args.out, args.lr, args.reference))
        return 0
    if args.cmd == "summary":
        print(summary(args.out, args.md, args.png))
        return 0
    default = {"lr": list(METHODS), "variants": list(VARIANTS), "width": [],
               "seeds": ["full", "lowrank", "galore", "pufferfish"]}[args.phase]
    methods = [m for m in args.methods.split(",") if m] if args.methods else default
    allowed = [*METHODS, *VARIANTS, *(["pufferfish"] if args.phase == "seeds" else [])]
    unknown = [m for m in methods if m not in allowed]
    if unknown:
        print(f"lm_budget: --methods {unknown[0]!r} is unknown; allowed {', '.join(allowed)}",
              file=sys.stderr)
        return 2
    try:
        budgets = tuple(float(b) for b in args.budgets.split(",") if b)
    except ValueError:
        budgets = (-1.0,)
    if not set(budgets) <= set(BUDGETS):
        print(f"lm_budget: --budgets {args.budgets!r} is invalid; allowed a subset of "
              f"{','.join(f'{b:g}' for b in BUDGETS)}", file=sys.stderr)
        return 2
    if args.phase == "width":
        import lm_width  # the width study builds on this module's runs

        def pending() -> list:
            return lm_width.queue(args.out)
    else:
        def pending() -> list:
            return queue(args.out, args.phase, methods, budgets)
    if args.dry_run:
        for item in pending():
            print("would run:", run_dir(args.out, *item))
        return 0
    tried: set = set()  # a finished run may queue the next (a choice made on it): ask again
    while todo := [item for item in pending() if item not in tried]:
        tried.add(todo[0])
        launch(args.out, *todo[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
