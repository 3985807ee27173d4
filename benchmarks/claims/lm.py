"""The language-model claims: DiLoCo on llama, the budget study (does the warm-up matter at 20
tokens per parameter?) and its recipe over emulated links; each from the cache, each setting
named by what it ran."""

from __future__ import annotations

import math
from pathlib import Path

import diloco_tta
import folders

from claims import DOCS, config_of, last_row, per_seed, record, stats
from pufferfish.bench import time_to_target as ttt

# -- DiLoCo on llama ----------------------------------------------------------------------------

DILOCO = {h: tuple(folders.FOLDERS[f"diloco-h{h}-s{s}"] for s in (0, 1)) for h in (10, 30)}
LIKE = {"diloco": "ddp", "powersgd": "ddp", "pufferfish+diloco": "pufferfish"}
DILOCO_LINKS = {"100 Mbit/s": 1e8, "10 Mbit/s": 1e7}
LINKS = {"100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s"}


def _diloco_times(run: Path, ref: Path, target: float) -> tuple[dict[str, float | None], list]:
    """Seconds to ``target`` (validation loss) per link, interpolated, with ``ref``'s compute per
    step (diloco_tta.py --compute-like), and the (step, ppl) points."""
    rows, ref_rows = diloco_tta.rows_of(run), diloco_tta.rows_of(ref)
    steps = next(r["steps"] for r in rows if "steps" in r)
    per_step = sum(r["compute_time"] for r in ref_rows) / sum(r.get("steps", 1) for r in ref_rows)
    points = diloco_tta.points(run, rows, steps)
    at = ttt.reach(points, target, interpolate=True)
    times = {name: None if at is None else diloco_tta.clock(rows, steps, at, bps, per_step)
             for name, bps in DILOCO_LINKS.items()}
    curve = [(diloco_tta.clock(rows, steps, s, 1e8, per_step), math.exp(loss))
             for s, loss in points]
    return times, curve


MOMENTS = {"project": "projected", "reset": "reset", "auto": "as `auto` carries them"}


def knobs(run: Path) -> list[str]:
    """The settings a compressed or infrequent run ran at: PowerSGD's rank, DiLoCo's H and the
    outer steps it took (what "never reached" depends on)."""
    cfg, last = config_of(run), last_row(run)
    said = [f"rank {cfg['powersgd_rank']}"] if cfg.get("comm") == "powersgd" else []
    if cfg.get("sync") == "diloco":
        said.append(f"H = {cfg['inner_steps']}, {last.get('outer_steps', '?')} outer steps")
    return said


def setting(run: Path) -> str:
    """What a (full-rank-phase) run trained, named by what it does: a switch after one step is
    low rank from an SVD of the barely trained initial weights, not the paper's warm-up."""
    cfg = config_of(run)
    if cfg["mode"] != "pufferfish":
        return {"full": "full rank", "lowrank": "low rank from the start"}.get(cfg["mode"],
                                                                             cfg["mode"])
    steps = float(cfg.get("warmup_steps") or 0)
    moments = f"Adam's moments {MOMENTS.get(cfg['switch_momentum'], cfg['switch_momentum'])}"
    return (f"SVD-initialized low rank (the switch after step {steps:.0f}, {moments})"
            if steps >= 1 else f"Pufferfish ({steps:.0%} full-rank warm-up, {moments})")


def with_knobs(label: str, run: Path) -> str:
    """'powersgd (rank 4)': a method's label with the settings it ran at."""
    said = knobs(run)
    return f"{label} ({'; '.join(said)})" if said else label


def diloco_claim(cache: Path) -> tuple[dict, dict]:
    """Time to DDP's final validation perplexity + 5% (same seed), llama ¼, one epoch."""
    by_link: dict[str, dict[str, dict[int, float | None]]] = {k: {} for k in DILOCO_LINKS}
    sources, curves, targets, settings = [], {}, {}, {}
    for h, names in DILOCO.items():
        for seed, name in enumerate(names):
            folder = cache / name
            if not (folder / "ddp/metrics.jsonl").is_file():
                continue
            ddp_ppl = last_row(folder / "ddp")["val_ppl"]
            targets[seed] = 1.05 * ddp_ppl
            for m in ("ddp", "powersgd", "pufferfish", "diloco", "pufferfish+diloco"):
                if "diloco" not in m and h == 10:
                    continue  # the same runs as in the H = 30 folder
                label = f"{m} H={h}" if "diloco" in m else m
                times, curve = _diloco_times(folder / m, folder / LIKE.get(m, m),
                                             math.log(targets[seed]))
                for link, t in times.items():
                    by_link[link].setdefault(label, {})[seed] = t
                curves[(label, seed)] = curve
                sources.append(folder / m)
                settings.setdefault(label, with_knobs(m, folder / m))
    methods = {m: stats(v) for m, v in by_link["100 Mbit/s"].items()}
    never = [m for m, e in methods.items() if all(v is None for v in e["seeds"].values())]
    first = {link: {s: min((m for m in v if v[m].get(s) is not None),
                           key=lambda m: v[m][s], default=None) for s in targets}
             for link, v in by_link.items()}
    met = all(f == "pufferfish+diloco H=30" for d in first.values() for f in d.values())
    names = {f for d in first.values() for f in d.values()}
    winners = (f"{names.pop()} on every link and seed" if len(names) == 1 else "; ".join(
        f"{link}: " + " / ".join(f"{d[s]} (seed {s})" for s in d) for link, d in first.items()))
    pufferfish = setting(cache / DILOCO[30][0] / "pufferfish")
    puff = methods["pufferfish"]
    steps = last_row(cache / DILOCO[30][0] / "ddp")["steps"]
    ours = (f"target ppl {' / '.join(f'{t:.1f}' for t in targets.values())} (seeds "
            f"{' / '.join(map(str, targets))}): first {winners} ({per_seed(puff, '{:.0f} s')} "
            f"over 100 Mbit/s); within the epoch, never reached by "
            f"{', '.join(settings[m] for m in never) or 'none'} (llama ¼, one epoch; pufferfish: "
            f"{pufferfish})")
    return record(
        "diloco", "DiLoCo and Pufferfish + DiLoCo: time to DDP's final perplexity + 5%",
        "(DiLoCo not in the paper)", "seconds to the target over 100 Mbit/s (modelled)",
        "Pufferfish + DiLoCo (H = 30) first over 100 and 10 Mbit/s on every seed", met,
        methods | {"by_link": {k: {m: stats(v) for m, v in d.items()}
                               for k, d in by_link.items()}},
        "python benchmarks/diloco_tta.py DIR --target LN(1.05 x DDP's final ppl) --interpolate "
        "--compute-like diloco=ddp,powersgd=ddp,pufferfish+diloco=pufferfish (each folder)",
        sources,
        f"One epoch ({steps} steps) and an α-β model of the link (compute per step of the seed's DDP "
        "/ Pufferfish run, plus bytes on the wire; seed 0's ran on cores shared with a test run, so "
        "its seconds are longer than seed 1's), not a run over it; PowerSGD's encoding is not "
        "counted. Far from DiLoCo's regime (thousands of steps): its runs end far above DDP, so "
        "this target says nothing about DiLoCo's final quality.",
        "validation",  # H fixed in advance; the LR (3e-3) from the width-0.25 LR sweep's seed 0
        ("DiLoCo (llama ¼): time to DDP's final perplexity + 5%", "–", ours,
         f"[DiLoCo]({DOCS}#diloco), "
         "[plot](docs/img/diloco-llama.png)")), {"curves": curves, "targets": targets}


# -- the language-model budget study -------------------------------------------------------------

def _setting_at(rows: list[dict], out: Path, method: str, budget: float) -> str:
    """A study setting named by what its seed-0 run trained, its code name beside it."""
    import lm_budget

    run = lm_budget.run_dir(out, budget, method, lm_budget.chosen_lr(out, method), 0)
    return f"{setting(run)} (`{method}`)"


def _at_lr(rows: list[dict], out: Path, method: str, budget: float) -> dict[int, float]:
    """Test perplexity per seed of ``method`` at its LR chosen on validation, at ``budget``."""
    import lm_budget

    lr = lm_budget.chosen_lr(out, method)
    return {r["seed"]: r["test_ppl"] for r in rows
            if r["method"] == method and r["budget"] == budget and r["lr"] == lr}


def budget_claim(cache: Path) -> dict:
    """The decision rule at the budget where the LRs were tuned (20 tokens/param), with its
    resolution; the 1 and 5 tokens/param runs reuse those LRs, so no claim rests on them."""
    import lm_budget

    out = folders.folder(cache, "lm-budget")
    rows = lm_budget.table(out) if out.is_dir() else []
    at = lm_budget.LR_BUDGET
    puff = lm_budget.best_pufferfish(out) if rows else None
    per = {m: stats(_at_lr(rows, out, m, at)) for m in ("full", "lowrank", *([puff] if puff else []))}
    verdict = next((v for v in (lm_budget.verdicts(out, rows) if rows else [])
                    if v["budget"] == at), None)
    seeds = len(lm_budget.SEEDS)
    untuned = ", ".join(f"{b:g}" for b in lm_budget.BUDGETS if b != at)
    met = None if verdict is None else verdict["matters"]
    ours = "not run yet: python benchmarks/lm_budget.py run OUT"
    if met is not None:
        f, low = per["full"], per["lowrank"]
        bar = 2 * max(f["spread"], low["spread"])
        ours = (f"{at:g} tokens/param (where the LRs were tuned), mean test ppl over {seeds} seeds: "
                f"full rank {f['mean']:.2f}, low rank from the start {low['mean']:.2f}"
                + (f", {_setting_at(rows, out, puff, at)} {per[puff]['mean']:.2f}" if puff else "")
                + f"; the rule cannot tell apart differences under {bar:.2f} ppl "
                f"({100 * bar / f['mean']:.0f}% of full rank's) with {seeds} seeds: no sign that "
                f"the warm-up matters at this resolution; at {untuned} tokens/param the LR was not "
                "tuned (docs only)")
    return record(
        "lm-budget", "Language-model budget study: does the warm-up matter at 20 tokens/param?",
        "(not in the paper)", "test perplexity",
        f"warm-up matters at {at:g} tokens/param: full rank beats low rank from the start by > 2x "
        "the seed spread, and Pufferfish recovers ≥ half of that gap", met,
        {m: e for m, e in per.items() if e["seeds"]},
        f"python benchmarks/lm_budget.py summary {out}", [out] if rows else [],
        f"{_widths(out)} ({_width_note(out)}); kjv+gcide; LRs and "
        "Pufferfish's setting chosen "
        f"on validation at {at:g} tokens/param, seed 0, and reported on test; a rule on max − min "
        f"of {seeds} seeds is blind to differences under twice that spread.",
        "validation", ("LM budget study (llama ⅛, kjv+gcide)", "–", ours,
                       f"[budget study]({DOCS}#language-models-at-a-budget-does-the-warm-up-"
                       "matter-at-20-tokens-per-parameter)"))


def _widths(out: Path) -> str:
    """The llama widths the study's verdicts cover: width 0.125, and 0.25 once its rule has
    answered."""
    import lm_budget
    import lm_width

    wide = out.is_dir() and lm_width.verdict(out) is not None
    return (f"llama widths {lm_budget.WIDTH:g} and {lm_width.WIDE:g}" if wide
            else f"llama width {lm_budget.WIDTH:g} only")


def _width_note(out: Path) -> str:
    """What the width-0.25 study (benchmarks/lm_width.py) has found, or how far it is."""
    import lm_width

    if not out.is_dir():
        return f"the width-{lm_width.WIDE:g} study not run"
    found = lm_width.verdict(out)
    if found is None:
        done = "; ".join(f"{m} at lr {lr:g}, seed {seed}: val ppl {last['val_ppl']:.2f}"
                         for m, lr, seed, last in lm_width.finished_runs(out))
        return (f"the width-{lm_width.WIDE:g} study, `lm_budget.py run OUT --phase width`, has "
                f"{len(lm_width.queue(out))} run(s) queued" + (f"; so far {done}" if done else ""))
    return f"the width-{lm_width.WIDE:g} study: {found['text']}"


def budget_links_claim(cache: Path) -> dict:
    """The budget study's recipe over emulated links (benchmarks/lm_links.py): the method first to
    DDP's final validation perplexity + 5% over 100 and 10 Mbit/s among six, judged by rounds."""
    import lm_budget
    import lm_links

    out = folders.folder(cache, "lm-budget")
    found = lm_links.results(out) if out.is_dir() else "not run"
    slow = ("100mbit", "10mbit")
    ready = (not isinstance(found, str) and all(link in found["links"] for link in slow)
             and all(r["run"] is not None for r in found["rows"]))  # every LR grid finished
    methods, ours, met = {}, f"not run yet: python benchmarks/lm_links.py run {out}", None
    tried = lm_links.settings_tried(out) if ready else {}
    knobs = ("PowerSGD and DiLoCo each at the best of its LR grid and of its own settings "
             f"({len(lm_links.SETTINGS['powersgd'])} ranks and start steps, "
             f"{len(lm_links.SETTINGS['diloco'])} H and outer LRs) on validation"
             if all(n == len(lm_links.SETTINGS[m]) for m, n in tried.items()) else
             "PowerSGD and DiLoCo each at the best of its LR grid on validation, at rank 4 and "
             "H 30 (of their own settings, `lm_links.py run` has tried "
             + ", ".join(f"{m} {n} of {len(lm_links.SETTINGS[m])}" for m, n in tried.items())
             + ")")
    if ready:
        runs = {r["method"]: r for r in found["rows"]}
        puff = Path(runs["pufferfish"]["run"])
        short = "svd-init" if float(config_of(puff).get("warmup_steps") or 0) >= 1 else "pufferfish"
        label = {m: with_knobs(m.replace("pufferfish", short), Path(r["run"]))
                 for m, r in runs.items()}
        methods = {f"{r['method']}: s to target @ {link}": stats({0: r["seconds_to_target"][link]})
                   for r in found["rows"] for link in found["links"]}
        verdicts = {link: lm_links.verdict(found, link) for link in slow}
        met = all(first in lm_links.FULL_PHASE and apart for first, _, apart in verdicts.values())
        never = [label[m] for m, r in runs.items()
                 if all(v is None for v in r["seconds_to_target"].values())]
        cells = []
        for link, (first, rival, apart) in verdicts.items():
            t = lm_links.round_times(runs[first], found["rows"], link)
            near = lm_links.round_times(runs[rival], found["rows"], link) if rival else None
            cells.append(f"{LINKS[link]}: first {label[first]}, {t[0]:,.0f}–{t[1]:,.0f} s over the "
                         "bench's rounds" + (f" against {label[rival]}'s {near[0]:,.0f}–"
                                             f"{near[1]:,.0f} s" if near else "")
                         + ("" if apart else ": the rounds overlap, a tie"))
        ours = (f"to val ppl {found['target']:.2f} (DDP's final + 5%): " + "; ".join(cells)
                + (f"; never reached at the settings they ran: {', '.join(never)}" if never else "")
                + f" ({short}: {setting(puff)}, chosen among the study's settings on seed 0's "
                "validation)")
    return record(
        "lm-budget-links", "LM budget study over links: first to DDP's final + 5%",
        "(not in the paper)", "seconds to the target",
        "a Pufferfish method (alone or composed) first over 100 and 10 Mbit/s among six, its "
        "worst bench round ahead of every other method's best", met, methods,
        f"python benchmarks/lm_links.py table {out}", [out / "links"] if ready else [],
        f"llama width {lm_budget.WIDTH:g}, {lm_budget.LR_BUDGET:g} tokens/param, seed 0; step "
        "times from `pufferfish bench` on 2 CPU processes over emulated links, steps to the target "
        "from each run's validation curve; the Pufferfish setting was chosen among the study's "
        f"on seed 0's validation; {knobs}, the compositions at their baseline's LR and setting.",
        "validation", ("LM budget study over links (llama ⅛, 20 tok/param)", "–", ours,
                       f"[over the links]({DOCS}#over-the-links-20-tokens-per-parameter-seed-0)"))
