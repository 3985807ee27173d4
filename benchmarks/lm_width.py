"""The budget study at width 0.25: which llama default (method and LR) holds at a wider model?

``python benchmarks/lm_budget.py run OUT --phase width`` runs this module's :func:`queue`, asked again after each run, into
``OUT/w0.25/tpp20/`` (20 tokens per parameter, the study's recipe, ``lm_budget.BASE``): full rank
and low rank from the start at the two ladder LRs around width 0.125's chosen LR scaled as
1/width (:func:`lrs`), then Pufferfish with the default switch (10% of the steps,
``--switch-momentum auto``) at full rank's better LR, then seed 1 of full and low rank where the
two land within the resolution below.

    python benchmarks/lm_width.py summary OUT

The rule, fixed before the runs finished, every choice on validation (as at width 0.125, where
low rank from the start had the best mean validation perplexity): each method at its better LR of
the two; llama's default at width 0.25 is whichever of low rank from the start and Pufferfish's
default switch has the lower mean validation perplexity over its seeds. How sure that is: width
0.125's resolution at 20 tokens per parameter, twice the larger relative max - min of validation
perplexity over its seeds ((max - min) / mean, full rank and low rank at their chosen LRs;
relative, since perplexity roughly halves from width 0.125 to 0.25); each method's distance to
full rank, and the two candidates' distance, are stated against it, with this width's own seed
spreads beside it (an observation; the rule's resolution stays width 0.125's). The chosen method's LR is the
default LR's measured point at 0.25 (``pufferfish.models.llama.LLAMA_LR_MEASURED``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lm_budget as study

WIDE = study.WIDE
PUFF = "puff10auto"


def lrs(out: Path, width: float = WIDE) -> list[float]:
    """The two ladder LRs around full rank's chosen LR at width 0.125 scaled as 1/width (the
    scaled LR itself when it is on the ladder, with its upper neighbour)."""
    base = study.chosen_lr(out, "full") or 1e-2
    scaled = base * study.WIDTH / width
    below = max(lr for lr in study.LADDER if lr <= scaled * 1.0001)
    return [below, study.LADDER[study.LADDER.index(below) + 1]]


def _val(out: Path, method: str, lr: float, seed: int = 0, width: float = WIDE) -> float | None:
    return study.best_val(study.run_dir(out, study.LR_BUDGET, method, lr, seed, width))


def better_lr(out: Path, method: str, width: float = WIDE) -> float | None:
    """``method``'s LR of :func:`lrs` with the lower final validation perplexity, seed 0."""
    vals = {lr: _val(out, method, lr, 0, width) for lr in lrs(out, width)}
    return None if None in vals.values() else min(vals, key=vals.__getitem__)  # type: ignore


def resolution(out: Path) -> float:
    """Width 0.125's resolution at 20 tokens per parameter, a fraction: twice the larger
    (max - min) / mean of validation perplexity over the seeds of full rank and low rank at their
    chosen LRs."""
    rows = study.table(out)
    spreads = [(max(v) - min(v)) * len(v) / sum(v) for m in ("full", "lowrank")
               if len(v := [r["val_ppl"] for r in rows if r["method"] == m and r["budget"] ==
                            study.LR_BUDGET and r["lr"] == study.chosen_lr(out, m)]) > 1]
    return 2 * max(spreads, default=0.0)


def mean_val(out: Path, method: str, lr: float, width: float = WIDE) -> tuple[float, int] | None:
    """The mean final validation perplexity over ``method``'s finished seeds, and their count."""
    vals = _seed_vals(out, method, lr, width)
    return (sum(vals) / len(vals), len(vals)) if vals else None


def queue(out: Path, width: float = WIDE) -> list[tuple[float, str, float, int, float]]:
    """The width phase's runs still to do, in order (see the module's docstring)."""
    todo = [(study.LR_BUDGET, m, lr, 0, width) for lr in lrs(out, width) for m in ("full", "lowrank")]
    lr_full, lr_low = better_lr(out, "full", width), better_lr(out, "lowrank", width)
    if lr_full is not None:
        todo.append((study.LR_BUDGET, PUFF, lr_full, 0, width))
    if lr_full is not None and lr_low is not None:
        full, low = _val(out, "full", lr_full, 0, width), _val(out, "lowrank", lr_low, 0, width)
        if abs(full - low) <= resolution(out) * full:  # type: ignore[operator]
            todo += [(study.LR_BUDGET, "full", lr_full, 1, width),
                     (study.LR_BUDGET, "lowrank", lr_low, 1, width)]
    return [t for t in todo if study.finished(study.run_dir(out, *t)) is None]


def verdict(out: Path, width: float = WIDE) -> dict | None:
    """The rule's answer once its runs have finished: ``{"default", "text", "lrs", "vals"}``,
    ``default`` ``lowrank`` or ``pufferfish`` (:data:`PUFF`); None while runs are pending."""
    if queue(out, width):
        return None
    chosen = {"full": better_lr(out, "full", width), "lowrank": better_lr(out, "lowrank", width)}
    chosen[PUFF] = chosen["full"]
    vals = {m: mean_val(out, m, lr, width) for m, lr in chosen.items()}  # type: ignore[arg-type]
    bar, full = resolution(out), vals["full"][0]  # type: ignore[index]
    gap = {m: v[0] / full - 1 for m, v in vals.items() if v is not None}
    best = min(("lowrank", PUFF), key=gap.__getitem__)
    apart = abs(gap["lowrank"] - gap[PUFF]) > bar
    shown = ", ".join(f"{m} {v[0]:.2f} (lr {chosen[m]:g}, {v[1]} seed{'s' * (v[1] > 1)})"
                      for m, v in vals.items() if v is not None)
    name = {"lowrank": "low rank from the start", PUFF: "Pufferfish's default switch"}
    text = (f"width {width:g}, 20 tokens/param, validation perplexity: {shown}; against full "
            f"rank, low rank from the start {gap['lowrank']:+.1%}, Pufferfish's 10% switch "
            f"{gap[PUFF]:+.1%} (resolution {bar:.1%}, width {study.WIDTH:g}'s seeds): "
            f"{name[best]} is the default at this width"
            + ("" if apart else ", a point estimate within the resolution")
            + ("" if gap[best] <= bar else f"; it costs {gap[best]:.1%} against full rank, "
               "beyond the resolution") + _own_spread(out, chosen, width))
    return {"default": "lowrank" if best == "lowrank" else "pufferfish", "text": text,
            "lrs": chosen, "vals": vals}


def own_spread(out: Path, method: str, lr: float, width: float = WIDE) -> float | None:
    """(max - min) / mean of ``method``'s validation perplexity over its seeds at ``width``."""
    vals = _seed_vals(out, method, lr, width)
    return (max(vals) - min(vals)) * len(vals) / sum(vals) if len(vals) > 1 else None


def _seed_vals(out: Path, method: str, lr: float, width: float) -> list[float]:
    """``method``'s final validation perplexity at ``lr`` for each of its finished seeds."""
    return [v for seed in study.SEEDS if (v := _val(out, method, lr, seed, width)) is not None]


def _own_spread(out: Path, chosen: dict, width: float) -> str:
    """This width's own seed spreads, said beside the verdict: an observation, not the rule's
    resolution (which was fixed from width 0.125's seeds before these runs)."""
    shown = [f"{m} {s:.1%}" for m in ("full", "lowrank")
             if (s := own_spread(out, m, chosen[m], width)) is not None]
    return (f"; this width's own seeds, (max − min) / mean: {', '.join(shown)} (not the rule's "
            "resolution)") if shown else ""


def finished_runs(out: Path, width: float = WIDE) -> list[tuple[str, float, int, dict]]:
    """(method, lr, seed, last metrics row) of every finished run at ``width``."""
    found = []
    for path in sorted((out / f"w{width:g}" / f"tpp{study.LR_BUDGET:g}").glob("*-s*")):
        last = study.finished(path) if path.is_dir() else None
        if last is not None:
            method, lr, seed = path.name.rsplit("-", 2)
            found.append((method, float(lr[2:]), int(seed[1:]), last))
    return found


def summary(out: Path) -> str:
    """The width phase's runs (validation / test perplexity) and the rule's verdict."""
    lines = ["| method | lr | seed | val ppl | test ppl |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {lr:g} | {seed} | {last['val_ppl']:.2f} | {last['test_ppl']:.2f} |"
              for m, lr, seed, last in finished_runs(out)]
    found = verdict(out)
    pending = len(queue(out))
    lines += ["", found["text"] if found else f"no verdict yet: {pending} run(s) to go "
              f"(python benchmarks/lm_budget.py run {out} --phase width)"]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "summary":
        print("usage: python benchmarks/lm_width.py summary OUT", file=sys.stderr)
        sys.exit(2)
    print(summary(Path(sys.argv[2])))
