"""More headline claims (benchmarks/claims.py has the rules): parameter counts, DiLoCo on llama,
``make demo``, the language-model budget study; and the plots of accuracy against wall-clock."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import diloco_tta
from claims import DOCS, LINK_NAMES, coverage, final, last_row, per_seed, record, rows_of, stats

from pufferfish.bench import accuracy as acc

PAPER_COUNTS = {"resnet18": (11_173_962, 3_336_138), "vgg19_bn": (20_560_330, 8_370_634)}


def live_counts() -> dict[str, list[int]]:
    """Parameters of the paper's models at width 1.0 before and after factorizing (rank ¼, the
    paper's preset), computed now."""
    from pufferfish import factorize
    from pufferfish.lowrank.counting import count_params
    from pufferfish.models import build_at_width

    out = {}
    for name in PAPER_COUNTS:
        model = build_at_width(name, 1.0)
        before = count_params(model)
        factorize(model, rank_ratio=0.25, preset="paper")
        out[name] = [before, count_params(model)]
    return out


def counts_claim(counts: dict[str, list[int]], source: str) -> dict:
    methods = {f"{name} {kind}": {"seeds": {}, "mean": counts[name][i], "spread": 0}
               for name in PAPER_COUNTS for i, kind in enumerate(("full rank", "Pufferfish"))}
    off = max(abs(counts[n][i] / PAPER_COUNTS[n][i] - 1) for n in PAPER_COUNTS for i in (0, 1))
    r, v = counts["resnet18"], counts["vgg19_bn"]
    return record(
        "parameters", "Parameters at the paper's width (CIFAR-10 shapes, rank ¼)",
        "ResNet-18 11.2M → 3.3M, VGG-19-BN 20.56M → 8.37M", "parameters",
        "within 0.1% of the paper's counts", off < 1e-3, methods,
        "pufferfish factorize --model resnet18 vgg19_bn", [source],
        "Counts only: deterministic, no seeds. Our stem BatchNorm (+128) and VGG's conv biases "
        "(+5,504) differ from the paper's models (docs/models.md).", "fixed in advance",
        ("Parameters, ResNet-18 / VGG-19-BN (CIFAR-10 shapes)",
         "11.2M → 3.3M / 20.56M → 8.37M",
         f"{r[0] / 1e6:.2f}M → {r[1] / 1e6:.2f}M / {v[0] / 1e6:.2f}M → {v[1] / 1e6:.2f}M",
         f"[model sizes]({DOCS}#model-sizes)"))


# -- DiLoCo on llama ----------------------------------------------------------------------------

DILOCO = {10: ("diloco-llama-w0.25-kjv-e1", "diloco-llama-w0.25-kjv-e1-s1"),
          30: ("diloco-llama-w0.25-kjv-e1-h30", "diloco-llama-w0.25-kjv-e1-h30-s1")}
LIKE = {"diloco": "ddp", "powersgd": "ddp", "pufferfish+diloco": "pufferfish"}
DILOCO_LINKS = {"100 Mbit/s": 1e8, "10 Mbit/s": 1e7}


def _diloco_times(run: Path, ref: Path, target: float) -> tuple[dict[str, float | None], list]:
    """Seconds to ``target`` (validation loss) per link, interpolated, with ``ref``'s compute per
    step (diloco_tta.py --compute-like), and the (step, ppl) points."""
    rows, ref_rows = diloco_tta._rows(run), diloco_tta._rows(ref)
    steps = next(r["steps"] for r in rows if "steps" in r)
    per_step = sum(r["compute_time"] for r in ref_rows) / sum(r.get("steps", 1) for r in ref_rows)
    points = diloco_tta._points(run, rows, steps)
    at = diloco_tta._reached(points, target, True)
    times = {name: None if at is None else diloco_tta._clock(rows, steps, at, bps, per_step)
             for name, bps in DILOCO_LINKS.items()}
    curve = [(diloco_tta._clock(rows, steps, s, 1e8, per_step), math.exp(loss))
             for s, loss in points]
    return times, curve


def diloco_claim(cache: Path) -> tuple[dict, dict]:
    """Time to DDP's final validation perplexity + 5% (same seed), llama ¼, one epoch."""
    by_link: dict[str, dict[str, dict[int, float | None]]] = {k: {} for k in DILOCO_LINKS}
    sources, curves, targets = [], {}, {}
    for h, folders in DILOCO.items():
        for seed, name in enumerate(folders):
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
    methods = {m: stats(v) for m, v in by_link["100 Mbit/s"].items()}
    never = [m for m, e in methods.items() if all(v is None for v in e["seeds"].values())]
    first = {link: {s: min((m for m in v if v[m].get(s) is not None),
                           key=lambda m: v[m][s], default=None) for s in targets}
             for link, v in by_link.items()}
    met = all(f == "pufferfish+diloco H=30" for d in first.values() for f in d.values())
    names = {f for d in first.values() for f in d.values()}
    winners = (f"{names.pop()} on every link and seed" if len(names) == 1 else "; ".join(
        f"{link}: " + " / ".join(f"{d[s]} (seed {s})" for s in d) for link, d in first.items()))
    puff = methods["pufferfish"]
    ours = (f"target ppl {' / '.join(f'{t:.1f}' for t in targets.values())} (seeds "
            f"{' / '.join(map(str, targets))}): first {winners} ({per_seed(puff, '{:.0f} s')} "
            f"over 100 Mbit/s); never reached by {', '.join(never) or 'none'} (llama ¼, one "
            "epoch)")
    return record(
        "diloco", "DiLoCo and Pufferfish + DiLoCo: time to DDP's final perplexity + 5%",
        "(DiLoCo not in the paper)", "seconds to the target over 100 Mbit/s (modelled)",
        "Pufferfish + DiLoCo (H = 30) first over 100 and 10 Mbit/s on every seed", met,
        methods | {"by_link": {k: {m: stats(v) for m, v in d.items()}
                               for k, d in by_link.items()}},
        "python benchmarks/diloco_tta.py DIR --target LN(1.05 x DDP's final ppl) --interpolate "
        "--compute-like diloco=ddp,powersgd=ddp,pufferfish+diloco=pufferfish (each folder)",
        sources,
        "One epoch (456 steps) and an α-β model of the link (compute per step of the idle DDP / "
        "Pufferfish run, plus bytes on the wire), not a run over it; PowerSGD's encoding is not "
        "counted. Far from DiLoCo's regime (thousands of steps): its runs end far above DDP, so "
        "this target says nothing about DiLoCo's final quality.", "fixed in advance",
        ("DiLoCo (llama ¼): time to DDP's final perplexity + 5%", "–", ours,
         f"[DiLoCo]({DOCS}#diloco), "
         "[plot](docs/img/diloco-llama.png)")), {"curves": curves, "targets": targets}


# -- make demo -------------------------------------------------------------------------------


def demo_claim(cache: Path) -> dict:
    demo, cl = cache / "demo-2026-12-05", cache / "resnet18-w0.25-fashion-cl"
    pairs = {0: (demo / "pufferfish", demo / "ddp")}
    if (cl / "sub45k-puff4-s1/metrics.jsonl").is_file():
        pairs[1] = (cl / "sub45k-puff4-s1", cl / "sub45k-full3-s1")
    gaps = stats({s: final(p) - final(d) for s, (p, d) in pairs.items()})
    timed = json.loads((demo / "train_results.json").read_text())["runs"]
    secs = {r["method"]: r["train_time"] for r in timed}
    ratio = secs["pufferfish"] / secs["ddp"]
    fewer = last_row(demo / "ddp")["params"] / last_row(demo / "pufferfish")["params"]
    worst = min(gaps["seeds"].values())
    methods = {"accuracy gap": gaps, "time vs DDP": stats({0: ratio})}
    notes = coverage({"accuracy gap": set(pairs), "time vs DDP": {0}},
                     {"accuracy gap": "sub45k-puff4", "time vs DDP": "demo (100 Mbit/s) seed"})
    return record(
        "demo", "`make demo`: equal wall-clock budget over 100 Mbit/s",
        "–", "points; time as a fraction of DDP's", "within 0.5 points of DDP in less time",
        worst >= -0.5 and ratio < 1, methods, "make demo", [*(p for pr in pairs.values()
                                                              for p in pr),
                                                            demo / "train_results.json"],
        "Width 0.25, 45,000 images, 3 DDP epochs against 4 Pufferfish epochs on 2 CPU cores: "
        "the time is seed 0's only (seed 1 trained over loopback, not over the link). It does "
        "not show Pufferfish more accurate for the same time.", "fixed in advance",
        ("`make demo` (width 0.25, equal wall-clock budget, 2 CPU cores)", "–",
         f"points vs DDP: {per_seed(gaps, '{:+.2f}')} (seed 1 over loopback), {fewer:.2f}x "
         f"fewer parameters, in {ratio:.2f}x the time: {1 / ratio:.2f}x faster (time: seed 0 "
         "only)",
         f"[the demo]({DOCS}#make-demo)"), notes)


PEERS = ("ddp", "powersgd", "pufferfish", "pufferfish+powersgd")


def demo_peers_claim(cache: Path) -> dict:
    """`make demo` with its peers: who reaches DDP's final - 0.5 first over the 100 Mbit/s link."""
    demo = cache / "demo-peers-2026-12-05"
    runs = {m: demo / "train" / "100mbit" / m for m in PEERS
            if (demo / "train" / "100mbit" / m / "metrics.jsonl").is_file()}
    command = "make demo   (benchmarks/demo.sh: 4 methods, 30,000 images, 100 Mbit/s)"
    title = "`make demo` with its peers: first to DDP's final − 0.5 over 100 Mbit/s"
    if "ddp" not in runs:
        return record("demo-peers", title, "–", "seconds", "a Pufferfish variant first", None,
                      {}, command, [], "Not run yet.", "fixed in advance",
                      ("`make demo` with its peers", "–", f"not run yet: `{command}`",
                       f"[the demo]({DOCS}#make-demo)"))
    target = final(runs["ddp"]) / 100 - 0.005
    reach = {m: acc.time_to_accuracy(list(rows_of(r)), target) for m, r in runs.items()}
    methods = {m: stats({0: t}) for m, t in reach.items()}
    reached = {m: t for m, t in reach.items() if t is not None}
    first = min(reached, key=reached.get) if reached else None
    met = first is not None and first.startswith("pufferfish")
    cells = ", ".join(f"{m} {'never' if t is None else f'{t:.0f} s'}" for m, t in reach.items())
    return record(
        "demo-peers", title, "–", "seconds of training to the target",
        "a Pufferfish variant reaches DDP's final − 0.5 first", met, methods, command,
        [*runs.values(), demo / "train_results.json"],
        "One seed (0), 2 CPU cores, ResNet-18 width 0.25 on 30,000 images: DDP 3 epochs, the "
        "others 4. Times are summed epoch times over the emulated link (evaluation excluded).",
        "fixed in advance",
        ("`make demo` with its peers (2 CPU cores, 100 Mbit/s, seed 0)", "–",
         f"to {100 * target:.2f}% (DDP's final − 0.5): {cells}; first: {first or 'none'}",
         f"[the demo]({DOCS}#make-demo)"))


# -- the language-model budget study ---------------------------------------------------------------


def budget_claim(cache: Path) -> dict:
    out = cache / "lm-budget"
    command = f"python benchmarks/lm_budget.py run {out} --phase lr; ... --phase seeds"
    rows: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    if out.is_dir():
        import lm_budget
        rows, = (lm_budget.table(out),)
        verdicts = lm_budget.verdicts(out, rows) if rows else []
    decided = [v for v in verdicts if v["matters"] is not None]
    methods = {}
    for r in rows:
        methods.setdefault(f"{r['method']} lr {r['lr']:g} @ {r['budget']:g} tok/param",
                           {})[r["seed"]] = r["test_ppl"]
    best: dict[str, dict[str, Any]] = {}  # each method's best LR so far, by validation
    for r in rows:
        if r["seed"] == 0 and r["budget"] == 20 and (
                r["method"] not in best or r["val_ppl"] < best[r["method"]]["val_ppl"]):
            best[r["method"]] = r
    so_far = ", ".join(f"{m} {r['test_ppl']:.2f} (lr {r['lr']:g})" for m, r in best.items())
    pending = [f"{v['budget']:g}" for v in verdicts if v["matters"] is None]
    ours = ("not run yet: " + command if not rows else "; ".join(v["text"] for v in decided)
            + (f"; running at {', '.join(pending)} tokens/param" if pending else "")
            if decided else
            f"running ({len(rows)} runs so far); test ppl at 20 tokens/param, seed 0, each "
            f"method's best LR so far on validation: {so_far}; no verdict before three seeds "
            "at each method's LR")
    return record(
        "lm-budget", "Language-model budget study: does the warm-up matter at N tokens/param?",
        "(not in the paper)", "test perplexity",
        "warm-up matters: full rank beats low rank from the start by > 2x the seed spread, and "
        "Pufferfish recovers ≥ half of that gap", None if not decided else any(
            v["matters"] for v in decided), {m: stats(v) for m, v in methods.items()},
        f"python benchmarks/lm_budget.py summary {out}", [out] if rows else [],
        "llama width 0.125 on kjv+gcide; LRs chosen on validation, reported on test.",
        "validation", ("LM budget study (llama ⅛, kjv+gcide)", "–", ours,
                       "[benchmarks/lm_budget.py](benchmarks/lm_budget.py)"))


def budget_links_claim(cache: Path) -> dict:
    """The budget study's recipe over emulated links (benchmarks/lm_links.py): the method first to
    DDP's final validation perplexity + 5% over 100 and 10 Mbit/s, among six."""
    out = cache / "lm-budget"
    import lm_links

    found = lm_links.results(out) if out.is_dir() else "not run"
    slow = ("100mbit", "10mbit")
    ready = (not isinstance(found, str) and all(link in found["links"] for link in slow)
             and all(r["run"] is not None for r in found["rows"]))  # every LR grid finished
    firsts = {link: lm_links.first(found, link) for link in slow} if ready else {}
    methods = {} if not ready else {
        f"{r['method']}: s to target @ {link}": stats({0: r["seconds_to_target"][link]})
        for r in found["rows"] if r["run"] is not None for link in found["links"]}
    ours = f"not run yet: python benchmarks/lm_links.py run {out}; ... bench; ... table"
    if ready:
        secs = {r["method"]: r["seconds_to_target"] for r in found["rows"] if r["run"]}
        never = [m for m, t in secs.items() if all(v is None for v in t.values())]
        ours = (f"to val ppl {found['target']:.2f} (DDP's final + 5%): " + "; ".join(
            f"{link}: first {firsts[link] or 'none'}" + (
                f" ({secs[firsts[link]][link]:,.0f} s, DDP {secs['ddp'][link]:,.0f} s)"
                if firsts[link] and secs.get("ddp", {}).get(link) else "") for link in slow)
            + (f"; never reached by {', '.join(never)}" if never else ""))
    met = None if not ready else all(firsts[link] in lm_links.FULL_PHASE for link in slow)
    return record(
        "lm-budget-links", "LM budget study over links: first to DDP's final + 5%",
        "(not in the paper)", "seconds to the target",
        "a Pufferfish method (alone or composed) first over 100 and 10 Mbit/s among six",
        met, methods, f"python benchmarks/lm_links.py table {out}", [out / "links"] if ready else [],
        "llama width 0.125, 20 tokens/param, seed 0; step times from `pufferfish bench` on 2 "
        "CPU processes over emulated links, steps to the target from each run's validation "
        "curve; PowerSGD and DiLoCo each at the best of its LR grid on validation (the study's "
        "rule), the compositions at their baseline's LR.", "validation",
        ("LM budget study over links (llama ⅛, 20 tok/param)", "–", ours,
         "[benchmarks/lm_links.py](benchmarks/lm_links.py)"))


# -- plots ------------------------------------------------------------------------------------


def plot_tta(curves_by_seed: dict[int, list[acc.Curve]], links: list[str], title: str,
             png: Path) -> None:
    """Test accuracy against modelled wall-clock, one panel per link, a line style per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.2), squeeze=False)
    colors = {}
    for ax, link in zip(axes[0], links):
        for seed, curves in curves_by_seed.items():
            for c in (c for c in curves if c.regime == link):
                color = colors.setdefault(c.method, f"C{len(colors)}")
                ax.plot([t / 3600 for t in c.times], [100 * a for a in c.accuracies],
                        ("-" if seed == min(curves_by_seed) else "--"), color=color,
                        label=f"{c.method} s{seed}")
        ax.set_title(LINK_NAMES.get(link, link), fontsize=9)
        ax.set_xlabel("hours (steps x measured step time)", fontsize=8)
        lows = [100 * a for cs in curves_by_seed.values() for c in cs for a in c.accuracies[-4:]]
        ax.set_ylim(min(lows) - 1, max(lows) + 0.5)
    axes[0][0].set_ylabel("test accuracy (%)", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def plot_diloco(data: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
    colors: dict[str, str] = {}
    for ax, seed in zip(axes, sorted(data["targets"])):
        for (label, s), curve in data["curves"].items():
            if s != seed:
                continue
            color = colors.setdefault(label, f"C{len(colors)}")
            ax.plot([t for t, _ in curve], [p for _, p in curve], color=color, label=label)
        ax.axhline(data["targets"][seed], color="k", lw=0.8, ls=":", label="DDP final + 5%")
        ax.set_yscale("log")
        ax.set_ylim(50, 400)
        ax.set_title(f"seed {seed}, 100 Mbit/s (modelled)", fontsize=9)
        ax.set_xlabel("seconds", fontsize=8)
    axes[0].set_ylabel("validation perplexity", fontsize=8)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
