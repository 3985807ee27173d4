"""The headline claims: every number of README.md's Results table, computed from the cache.

``benchmarks/paper.sh OUT`` calls :func:`build` and writes ``OUT/claims.json`` (one record per
claim: the paper's figure, ours per seed with mean and spread, the target, whether it is met, the
command, the cached files, what the claim does not show) and ``OUT/readme-results.md`` (the
README's table, rendered from those records: tests/test_paper_claims.py fails when README.md's
table differs). Seeds are matched: a comparison uses the seeds every method has, and a method
with fewer seeds says so ("seed 1 only", "missing runs: ...").

**Spread and "met".** ``spread`` is max - min over seeds (``null`` with one seed). A target is
met only when it holds on every seed (the worst seed, not the mean), and for times when it holds
in the bench's worst round; two methods are "apart" when their ranges (over seeds, or over the
bench's rounds) do not overlap, else the claim says that they overlap.
"""

from __future__ import annotations

import functools
import json
import statistics
import tomllib
from pathlib import Path
from typing import Any

from pufferfish.bench import accuracy as acc
from pufferfish.training.metrics import quality_key, read_metrics

DOCS = "docs/benchmarks.md"
LINK_NAMES = {"loopback": "loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}


# -- runs ------------------------------------------------------------------------------------


@functools.cache
def rows_of(run: Path) -> tuple[dict, ...]:
    """The run's metrics rows, read once per report."""
    return tuple(read_metrics(run))


def last_row(run: Path) -> dict:
    return rows_of(run)[-1]


def planned_epochs(run: Path) -> int:
    """The epochs the run was configured for (a run stopped early has fewer rows)."""
    return int(tomllib.loads((run / "config.toml").read_text())["epochs"])


def metric(row: dict) -> float:
    """A row's test accuracy in %, or its test perplexity (language models)."""
    key = quality_key(row)  # test_acc, test_ppl, or llama's val_ppl
    return 100 * row[key] if key == "test_acc" else row[key]


def final(run: Path) -> float:
    return metric(last_row(run))


def partial_note(run: Path) -> str:
    """' (9 of 10 epochs)' for a run stopped before its budget, else ''."""
    done, planned = len(rows_of(run)), planned_epochs(run)
    return f" ({done} of {planned} epochs)" if done < planned else ""


def is_lm(run: Path) -> bool:
    return quality_key(last_row(run)) != "test_acc"


def gap(run: Path, ref: Path) -> float:
    """Points of accuracy against ``ref``, or % of perplexity (positive: worse) for an LM, at
    the last epoch both reached (a run stopped early is compared with ``ref`` at that epoch)."""
    n = min(len(rows_of(run)), len(rows_of(ref)))
    a, b = metric(rows_of(run)[n - 1]), metric(rows_of(ref)[n - 1])
    return 100 * (a / b - 1) if is_lm(run) else a - b


# -- seeds, spreads, records -------------------------------------------------------------------


def stats(values: dict[int, float | None]) -> dict[str, Any]:
    """``{"seeds": {seed: value}, "mean", "spread"}``; a ``None`` value (a target never reached)
    is kept in ``seeds`` and left out of the mean; spread is max - min (``None`` for one seed)."""
    got = [v for v in values.values() if v is not None]
    return {"seeds": {str(s): values[s] for s in sorted(values)},
            "mean": statistics.mean(got) if got else None,
            "spread": max(got) - min(got) if len(got) > 1 else None}


def seed_range(entry: dict[str, Any]) -> tuple[float, float] | None:
    got = [v for v in entry["seeds"].values() if v is not None]
    return (min(got), max(got)) if got else None


def overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def coverage(have: dict[str, set[int]], names: dict[str, str]) -> list[str]:
    """Per method with fewer seeds than the others: "PowerSGD: seed 1 only (missing runs: psgd-s0)"."""
    every = set().union(*have.values())
    notes = []
    for method, seeds in have.items():
        missing = sorted(every - seeds)
        if missing:
            only = ", ".join(map(str, sorted(seeds))) or "none"
            notes.append(f"{method}: seed{'s' if len(seeds) > 1 else ''} {only} only (missing "
                         f"runs: {', '.join(f'{names[method]}-s{s}' for s in missing)})")
    return notes


def num(fmt: str, v: float | None) -> str:
    """``fmt.format(v)`` with a typographic minus; "never" for ``None`` (a target not reached)."""
    return "never" if v is None else fmt.format(v).replace("-", "−")


def per_seed(entry: dict[str, Any], fmt: str) -> str:
    """'+0.72 / +0.21 on seeds 0 / 1', or '+9.3% on seed 0 only'."""
    seeds = entry["seeds"]
    vals = " / ".join(num(fmt, v) for v in seeds.values())
    return (f"{vals} on seeds {' / '.join(seeds)}" if len(seeds) > 1
            else f"{vals} on seed {next(iter(seeds))} only")


def record(cid: str, title: str, paper: str, unit: str, target: str, met: bool | None,
           methods: dict[str, Any], command: str, sources: list[Path | str], limits: str,
           chosen_on: str, readme: tuple[str, str, str, str], notes: list[str] = ()) -> dict:
    """One claim. ``readme``: (row label, the paper's cell, our cell, details link)."""
    return {"id": cid, "title": title, "paper": paper, "unit": unit, "target": target,
            "met": met, "methods": methods, "command": command,
            "sources": sorted(map(str, sources)), "limits": limits, "chosen_on": chosen_on,
            "notes": list(notes),
            "readme": dict(zip(("row", "paper", "ours", "details"), readme))}


def _met_word(met: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not run yet"}[met]


def readme_table(claims: list[dict]) -> list[str]:
    """README.md's Results table: one row per claim, every number from ``claims``."""
    lines = ["| | the paper | pufferfish | target | details |", "|---|---|---|---|---|"]
    for c in claims:
        r = c["readme"]
        target = f"{c['target']}: {_met_word(c['met'])}"
        if c["chosen_on"] == "test":
            target += " (chosen on test, to be re-run)"
        lines.append(f"| {r['row']} | {r['paper']} | {r['ours']} | {target} | {r['details']} |")
    return lines


# -- time to accuracy from a bench's step times --------------------------------------------------


def bench_tta(results: Path, runs: dict[str, Path], points: float
              ) -> tuple[dict[tuple[str, str], dict], list[acc.Curve]]:
    """``{(link, method): target row}`` and the curves, the runs timed with the step times of a
    cached ``pufferfish bench`` (``bench/accuracy.py``'s rules; DDP of the same seed sets the
    target, ``points`` below its final accuracy)."""
    saved = json.loads(results.read_text())
    cfg = saved["config"]
    loaded = acc.load_accuracy_runs(
        ",".join(f"{m}={p}" for m, p in runs.items()), model=cfg["model"], width=cfg["width"],
        batch_size=cfg["batch_size"], powersgd_rank=cfg["powersgd_rank"],
        workers=cfg["workers"], processes=cfg.get("accuracy_processes") or 0)
    step_times = {(r["bandwidth"], r["method"]): acc.StepTime(r["step_time"],
                                                              *r["spread"]["step_time"])
                  for r in saved["rows"]}
    links = [link["bandwidth"] for link in saved["links"]]
    curves = acc.measured_curves(loaded, step_times, links, cfg["workers"])
    table = acc.target_table(curves, loaded["ddp"].accuracies[-1], points=(points,))
    return {(t["regime"], t["method"]): t for t in table}, curves


def _speedups(results: Path, folder: Path, names: dict[str, str], seeds: list[int],
              link: str, points: float) -> tuple[dict, dict, list[Path], dict]:
    """Per method: speed-up over DDP per seed, and its [worst, best] over the bench's rounds."""
    speed: dict[str, dict[int, float | None]] = {}
    rounds: dict[str, dict[int, list[float] | None]] = {}
    used: list[Path] = [results]
    curves_by_seed = {}
    for s in seeds:
        runs = {m: folder / f"{n}-s{s}" for m, n in names.items()
                if (folder / f"{n}-s{s}" / "metrics.jsonl").is_file()}
        table, curves = bench_tta(results, runs, points)
        curves_by_seed[s] = curves
        used += runs.values()
        for m in runs:
            row = table.get((link, m))
            v = None if row is None else row["speedup_vs_ddp"]
            speed.setdefault(m, {})[s] = v
            rounds.setdefault(m, {})[s] = None if v is None else [row["speedup_worst"],
                                                                   row["speedup_best"]]
    return speed, rounds, used, curves_by_seed


def tta_claim(cache: Path) -> tuple[dict, dict]:
    """Time to DDP −0.5 at the paper's width over 100 Mbit/s, with the automatic buckets."""
    folder = cache / "resnet18-w1-fashion-e20-gpu"
    results = cache / "buckets-2026-12-05/w1-auto-idle/results.json"
    names = {"ddp": "full", "pufferfish": "puff", "powersgd": "psgd"}
    speed, rounds, used, curves = _speedups(results, folder, names, [0, 1], "100mbit", 0.5)
    methods = {m: {**stats(v), "rounds": {str(s): r for s, r in rounds[m].items()}}
               for m, v in speed.items() if m != "ddp"}
    have = {m: {s for s in (0, 1) if (folder / f"{n}-s{s}" / "metrics.jsonl").is_file()}
            for m, n in names.items()}
    notes = coverage(have, names)
    puff_worst = [r[0] if r else 0.0 for r in rounds["pufferfish"].values()]
    met = min(puff_worst) >= 1.5
    matched = sorted(set(have["pufferfish"]) & set(have["powersgd"]))
    m_s = matched[0]
    p_r, q_r = rounds["pufferfish"][m_s], rounds["powersgd"][m_s]
    apart = not overlap(tuple(p_r), tuple(q_r))
    ours = (f"sooner to DDP −0.5, 2 workers over an emulated 100 Mbit/s link: Pufferfish "
            f"{per_seed(methods['pufferfish'], '{:.2f}x')}; PowerSGD {speed['powersgd'][m_s]:.2f}x on "
            f"seed {m_s} (Pufferfish {speed['pufferfish'][m_s]:.2f}x; round spreads "
            f"{'apart' if apart else 'overlap'}), seed {m_s} only")
    return record(
        "time-to-accuracy", "Time to accuracy vs DDP (ResNet-18, the paper's width)",
        "up to 1.64x end-to-end speed-up over DDP without accuracy loss", "x DDP's speed",
        "≥ 1.5x DDP to DDP −0.5 over 100 Mbit/s on every seed, worst bench round", met, methods,
        f"pufferfish bench --from-results {results} --accuracy-runs ddp=R/full-sS,"
        "pufferfish=R/puff-sS,powersgd=R/psgd-sS --accuracy-processes 1 (R="
        f"{folder}, each seed S)", used,
        "Two workers and one emulated link: the paper's clusters are not measured. Accuracy per "
        "epoch is from one-GPU runs (batch 128) timed with 2-process CPU step times at the same "
        "global batch; the time is modelled (steps x step time), not a run over the link. "
        f"PowerSGD has one seed and stops at 12 of 20 epochs; on seed {m_s} it is ahead.",
        "fixed in advance (the paper's recipe; target from the issue)",
        ("Time to accuracy vs DDP", "up to 1.64x sooner", ours,
         f"[time to accuracy]({DOCS}#time-to-accuracy-vs-ddp),"
         " [plot](docs/img/tta-w1.png)"), notes), curves


def composition_claim(cache: Path) -> tuple[dict, dict]:
    """Pufferfish + PowerSGD against PowerSGD at width 0.25, to DDP −1 over 100 Mbit/s."""
    folder = cache / "resnet18-w0.25-fashion-e6"
    results = folder / "bench/results.json"
    names = {"ddp": "full", "powersgd": "psgd", "pufferfish": "puff",
             "pufferfish+powersgd": "puffpsgd"}
    seeds = [s for s in (0, 1) if all((folder / f"{n}-s{s}").is_dir() for n in names.values())]
    speed, rounds, used, curves = _speedups(results, folder, names, seeds, "100mbit", 1.0)
    methods = {m: {**stats(v), "rounds": {str(s): r for s, r in rounds[m].items()}}
               for m, v in speed.items() if m != "ddp"}
    comp, psgd = rounds["pufferfish+powersgd"], rounds["powersgd"]
    met = all(comp[s] and psgd[s] and comp[s][0] > psgd[s][1] for s in seeds)
    ours = (f"DDP's speed to DDP −1 over 100 Mbit/s: Pufferfish + PowerSGD "
            f"{per_seed(methods['pufferfish+powersgd'], '{:.2f}x')}; PowerSGD "
            f"{per_seed(methods['powersgd'], '{:.2f}x')}; round spreads "
            f"{'apart' if met else 'overlap'} (width 0.25, 6 epochs)")
    return record(
        "composition", "Pufferfish composed with PowerSGD, against PowerSGD",
        "(not in the paper: it compares the two)", "x DDP's speed",
        "ahead of PowerSGD on every seed, the worst round above PowerSGD's best", met, methods,
        f"pufferfish bench --from-results {results} --accuracy-runs ddp=R/full-sS,powersgd="
        "R/psgd-sS,pufferfish=R/puff-sS,pufferfish+powersgd=R/puffpsgd-sS --compute-ms 30 "
        f"(R={folder}, each seed S)", used,
        "Width 0.25 and 6 epochs; DDP −1 only (neither Pufferfish run reaches DDP −0.5 here). "
        "Every method reaches the target at the same epoch on both seeds, so the seeds differ "
        "only through DDP's final accuracy. Not trained at the paper's width.",
        "fixed in advance", ("Pufferfish + PowerSGD vs PowerSGD", "–", ours,
                             f"[composed]({DOCS}#pufferfish--powersgd), "
                             "[plot](docs/img/composition-w025.png)")), curves


def _gaps(folder: Path, method: str, seeds: list[int], ref: str = "full") -> dict[int, float]:
    return {s: gap(folder / f"{method}-s{s}", folder / f"{ref}-s{s}") for s in seeds
            if (folder / f"{method}-s{s}" / "metrics.jsonl").is_file()}


def _runs(folder: Path, names: list[str], seeds: list[int]) -> list[Path]:
    return [folder / f"{n}-s{s}" for n in names for s in seeds
            if (folder / f"{n}-s{s}" / "metrics.jsonl").is_file()]


def _fmt_gap(v: float, lm: bool) -> str:
    return f"{v:+.1f}%" if lm else f"{v:+.2f}"


def accuracy_claim(cache: Path) -> dict:
    """Pufferfish against full rank at the paper's widths (one GPU, 20 epochs)."""
    r18, vgg = cache / "resnet18-w1-fashion-e20-gpu", cache / "vgg19-w1-fashion-e20-gpu"
    methods = {"ResNet-18 gap": stats(_gaps(r18, "puff", [0, 1])),
               "VGG-19-BN gap": stats(_gaps(vgg, "puff", [0, 1]))}
    worst = min(min(v for v in m["seeds"].values()) for m in methods.values())
    ours = (f"{num('{:+.3f}', methods['ResNet-18 gap']['mean'])} / "
            f"{num('{:+.3f}', methods['VGG-19-BN gap']['mean'])} points, mean of seeds 0 and 1 "
            f"(worst seed {num('{:+.2f}', worst)}; Fashion-MNIST, 20 epochs, one GPU)")
    return record(
        "accuracy-gap", "Accuracy gap at the paper's width", "no accuracy loss (CIFAR-10)",
        "points (Pufferfish − full rank)", "within 0.3 points of full rank on every seed", worst >= -0.3,
        methods, "python benchmarks/gpu_converged.py ... (docs/benchmarks.md)",
        _runs(r18, ["full", "puff"], [0, 1]) + _runs(vgg, ["full", "puff"], [0, 1]),
        "Fashion-MNIST, not CIFAR-10 or ImageNet; 20 epochs, not 300; two seeds, whose spread "
        f"(up to {max(m['spread'] for m in methods.values()):.2f} points) is as large as the gap.",
        "fixed in advance",
        ("Accuracy gap at the paper's width (ResNet-18 / VGG-19-BN)", "no accuracy loss (CIFAR-10)",
         ours, f"[converged]({DOCS}#accuracy-at-the-papers-width)"))


def warmup_claim(cache: Path) -> dict:
    folder = cache / "resnet18-w1-fashion-e20-gpu"
    worth = {s: -v for s, v in _gaps(folder, "lowrank", [0, 1], ref="puff").items()}
    entry = stats(worth)
    return record(
        "warm-up", "Full-rank warm-up vs low rank from the start",
        "+0.36 points (VGG-19, CIFAR-10)", "points (with warm-up − without)",
        "warm-up ahead on every seed", min(worth.values()) > 0, {"warm-up worth": entry},
        "pufferfish train --mode lowrank ... beside the puff runs (docs/benchmarks.md)",
        _runs(folder, ["puff", "lowrank"], [0, 1]),
        "ResNet-18 only (the paper's figure is VGG-19); two seeds whose spread is larger than "
        "the mean worth.", "fixed in advance",
        ("Full-rank warm-up vs low rank from the start", "+0.36 points (VGG-19)",
         f"{num('{:+.3f}', entry['mean'])} points (ResNet-18; {per_seed(entry, '{:+.2f}')})",
         f"[converged]({DOCS}#warm-up-vs-low-rank-from-the-start)"))


def lstm_claim(cache: Path) -> dict:
    folder = cache / "lstm-w1-kjv-e10-gpu"
    methods = {"paper's switch (10%)": stats(_gaps(folder, "puff", [0, 1])),
               "switch at half the run": stats(_gaps(folder, "pufflate", [0, 1]))}
    have = {k: {int(s) for s in m["seeds"]} | set() for k, m in methods.items()}
    notes = coverage(have | {"full rank": {0, 1}}, {"paper's switch (10%)": "puff",
                                                   "switch at half the run": "pufflate",
                                                   "full rank": "full"})
    short = [f"{r.name}{partial_note(r)}" for r in _runs(folder, ["puff", "pufflate"], [0, 1])
             if partial_note(r)]
    half = methods["switch at half the run"]
    ratio = last_row(folder / "full-s0")["params"] / last_row(folder / "pufflate-s0")["params"]
    paper_switch = methods["paper's switch (10%)"]
    ours = (f"perplexity vs full rank: at the paper's switch (10% warm-up) "
            f"{per_seed(paper_switch, '{:+.1f}%')}; switching at half the run "
            f"{per_seed(half, '{:+.1f}%')}; "
            f"{ratio:.2f}x fewer parameters (the KJV, 10 epochs)")
    return record(
        "lstm", "LSTM language model at the paper's size (1500 hidden)",
        "2-layer LSTM on WikiText-2 matches full rank", "% perplexity vs full rank",
        "the switch at half the run within 5% of full rank's test perplexity on every seed",
        all(v <= 5 for v in half["seeds"].values()), methods,
        "python benchmarks/gpu_converged.py ... (docs/benchmarks.md, the LSTM)",
        _runs(folder, ["full", "puff", "pufflate"], [0, 1]),
        "The KJV, not WikiText-2. The switch at half the run (the first LR drop) was picked after "
        "the paper's switch failed, on the test perplexity that is reported; the paper's switch "
        "has one seed. Runs stopped early (" + ", ".join(short) + ") are compared with full rank "
        "at their last epoch.", "test",
        ("LSTM language model at the paper's size (1500 hidden)", "2-layer LSTM on WikiText-2",
         ours, f"[the LSTM]({DOCS}#the-lstm)"), notes)


def llama_claim(cache: Path) -> dict:
    folder = cache / "llama-w0.5-kjv-e3-lr1e-3"
    names = {"paper's recipe (25% warm-up, moments reset)": "puff",
             "chosen: 5% warm-up, moments projected": "puffw5proj",
             "low rank from the start": "lowrank", "GaLore": "galore"}
    methods = {k: stats(_gaps(folder, n, [0, 1])) for k, n in names.items()}
    chosen, paper = methods["chosen: 5% warm-up, moments projected"], \
        methods["paper's recipe (25% warm-up, moments reset)"]
    ratio = last_row(folder / "full-s0")["params"] / last_row(folder / "puffw5proj-s0")["params"]
    ours = (f"{num('{:+.1f}%', chosen['mean'])} perplexity vs full rank "
            f"({per_seed(chosen, '{:+.1f}%')}) with a 5% warm-up and Adam's moments projected; "
            f"the paper's recipe {num('{:+.1f}%', paper['mean'])}; {ratio:.2f}x fewer parameters (width 0.5, the KJV, 3 epochs)")
    return record(
        "llama", "llama (width 0.5) on the KJV: the chosen Pufferfish variant",
        "(transformers not in the paper)", "% validation perplexity vs full rank",
        "within 2% of full rank on every seed", all(v <= 2 for v in chosen["seeds"].values()),
        methods, "benchmarks/llama_lr.sh (docs/benchmarks.md, llama on the KJV)",
        _runs(folder, ["full", *names.values()], [0, 1]),
        "The variant (5% warm-up, moments projected) was chosen among five on the validation "
        "perplexity that is also the reported figure: there is no held-out split behind it. Low "
        "rank from the start is better than full rank here (a small-data regime). One epoch "
        "budget, two seeds, CPU.", "test",
        ("llama ½ on the KJV (chosen variant)", "–", ours,
         f"[llama]({DOCS}#language-models-llama)"))
