"""The paper beside us: every claim of Pufferfish (Wang, Agarwal, Papailiopoulos, MLSys 2021) with
the paper's figure, ours, where ours came from and what differs, in one Markdown report with plots.

    benchmarks/paper.sh [--cache benchmarks/results] [--out runs/paper]

Parameter and MAC counts are computed live (seconds). Everything that needs training or timing is
read from the cache of earlier runs (``benchmarks/results/``: ``pufferfish train`` run directories
named ``<method>-s<seed>`` under one folder per experiment, and a ``bench/results.json`` of
``pufferfish bench`` beside them); the report names every cached file it used, and for a claim
without cached runs it prints the command that would make them instead of a number.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import claims as cl
import folders
import torch
from claims import final, gap, is_lm, last_row, partial_note, rows_of  # noqa: F401
from claims import plots as claim_plots

from pufferfish import count_macs, factorize
from pufferfish.formatting import markdown_table
from pufferfish.lowrank.counting import count_params
from pufferfish.models import build_at_width
from pufferfish.report import compare_runs

RUN_NAME = re.compile(
    r"^(?P<method>full|puffproj|puffkeep1|pufflate|puffpsgd|puffw2|puffw50|puffw5proj|puff|lowrank"
    r"|auto|psgd|galore)-s(?P<seed>\d+)$")
# An equal wall-clock budget (`make demo`'s comparison): DDP for E epochs against Pufferfish for
# the N that fit in the same time over 100 Mbit/s, runs named full{E}-s{seed} and puff{N}-s{seed}.
EQUAL_BUDGET = ((3, 4), (4, 6), (5, 7))
BUDGET_RUN = re.compile(r"^(?P<method>full|puff)(?P<epochs>\d+)-s(?P<seed>\d+)$")
# Pufferfish variants shown beside the paper's recipe in the accuracy claim: run name -> column.
VARIANTS = {"puffproj": "momentum projected", "puffkeep1": "`layer1` kept",
            "pufflate": "switch at the first LR drop", "auto": "auto",
            "puffpsgd": "with PowerSGD", "puffw2": "warm-up 2", "puffw50": "switch at half the run",
            "puffw5proj": "switch at 5%, moments projected",
            "galore": "GaLore (full rank, projected optimizer)"}
WHAT_DIFFERS = (
    "The paper trains ResNet-18 and VGG-19-BN at full width on CIFAR-10 (300 epochs), ResNet-50 on "
    "ImageNet and an LSTM on WikiText-2, on clusters of GPU machines. Here: Fashion-MNIST (the "
    "data this machine has), ResNet-18 at width 0.25 (a 2-core CPU trains the full-width model "
    "about 16x slower), 6-20 epochs, 2 processes on one machine, links emulated with `tc tbf` "
    "between network namespaces. The `*-gpu` experiments are the paper's widths (ResNet-18 "
    "11.17M, VGG-19-BN 20.56M parameters) for 20 epochs on one lent H200: one process at batch "
    "128 (the 2 x 64 of the CPU runs) with fp16 autocast. The method, presets and rank (¼) are "
    "the paper's."
)


@dataclass
class Section:
    title: str
    paper: str
    ours: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def markdown(self) -> list[str]:
        lines = [f"## {self.title}", "", f"**Paper:** {self.paper}", "", *self.ours]
        if self.sources:
            lines += ["", "Reused from the cache: " + ", ".join(f"`{s}`" for s in self.sources)]
        if self.missing:
            lines += ["", "**Not in the cache** (run, then regenerate this report):", "", "```",
                      *self.missing, "```"]
        return [*lines, ""]


def counts(mode: str, out: Path) -> tuple[Section, dict[str, list[int]], str]:
    """Parameters and MACs of the paper's models at width 1.0 on CIFAR-10 shapes, live (and
    written to ``out/param-counts.json``), or, with ``mode`` a file, the parameters read from an
    earlier ``param-counts.json`` (a quick check of the rest of the report)."""
    paper = {"resnet18": ("11,173,962", "3,336,138", "0.56G", "0.22G"),
             "vgg19_bn": ("20,560,330", "8,370,634", "0.40G", "(not quoted)")}
    if mode != "live":
        params = {k: v for k, v in json.loads(Path(mode).read_text()).items() if k in paper}
        rows = [[name, f"{p_full} → {p_low}", f"{params[name][0]:,} → {params[name][1]:,}",
                 f"{params[name][0] / params[name][1]:.2f}x"]
                for name, (p_full, p_low, _, _) in paper.items()]
        ours = markdown_table(["model", "paper params", "ours (read from " + mode + ")", "fewer"],
                              rows)
        return Section("Parameters (read from a file, not computed)", "as below", ours), \
            params, mode
    rows, params = [], {}
    for name, (p_full, p_low, m_full, m_low) in paper.items():
        model = build_at_width(name, 1.0)
        x = torch.randn(1, 3, 32, 32)
        full_params, full_macs = count_params(model), count_macs(model, x)
        factorize(model, rank_ratio=0.25, preset="paper")
        low_params, low_macs = count_params(model), count_macs(model, x)
        params[name] = [full_params, low_params]
        rows.append([name, f"{p_full} → {p_low}", f"{full_params:,} → {low_params:,}",
                     f"{full_params / low_params:.2f}x", f"{m_full} → {m_low}",
                     f"{full_macs / 1e9:.2f}G → {low_macs / 1e9:.2f}G"])
    (out / "param-counts.json").write_text(json.dumps(params, indent=1) + "\n")
    ours = markdown_table(["model", "paper params", "ours", "fewer", "paper MACs", "ours MACs"],
                          rows)
    ours += ["", "Ours: `pufferfish factorize --model resnet18 vgg19_bn`, computed now. The "
             "differences are our stem BatchNorm (+128) and VGG's conv biases (+5,504); "
             "docs/models.md."]
    return Section("Parameters and MACs (CIFAR-10 shapes, rank ¼, the paper's full-rank layers)",
                   "ResNet-18 11.17M → 3.34M parameters, 0.56G → 0.22G MACs; VGG-19-BN "
                   "20.56M → 8.37M parameters.", ours), params, "computed live"


def experiments(cache: Path) -> dict[str, dict[str, dict[int, Path]]]:
    """experiment folder -> method -> seed -> run directory, for every cached training run."""
    found: dict[str, dict[str, dict[int, Path]]] = {}
    for run in sorted(cache.glob("*/*/metrics.jsonl")):
        m = RUN_NAME.match(run.parent.name)
        if m:
            found.setdefault(run.parent.parent.name, {}).setdefault(m["method"], {})[
                int(m["seed"])] = run.parent
    return found


def shown(run: Path) -> str:
    value = f"{final(run):.1f} ppl" if is_lm(run) else f"{final(run):.2f}%"
    return value + partial_note(run)


def shown_gap(value: float, lm: bool) -> str:
    return f"{value:+.1f}%" if lm else f"{value:+.2f}"


def parity(found: dict[str, dict[str, dict[int, Path]]], out: Path) -> Section:
    section = Section("Accuracy: Pufferfish vs full rank",
                      "the same accuracy as the full-rank model (\"no accuracy loss\"), with "
                      "3.3x fewer parameters for ResNet-18.")
    for exp, methods in found.items():
        seeds = sorted(set(methods.get("full", {})) & set(methods.get("puff", {})))
        if not seeds:
            continue
        variants = [v for v in VARIANTS if any(s in methods.get(v, {}) for s in seeds)]
        rows: list[list[str]] = []
        gaps = []
        lm = is_lm(methods["full"][seeds[0]])
        for s in seeds:
            full, puff = methods["full"][s], methods["puff"][s]
            gaps.append(gap(puff, full))
            p_full, p_low = (last_row(r)["params"] for r in (full, puff))
            cells = []
            for v in variants:
                run = methods[v].get(s)
                cells.append("-" if run is None else
                             f"{shown(run)} ({shown_gap(gap(run, full), lm)})")
                section.sources += [str(run)] if run else []
            rows.append([str(s), shown(full), shown(puff), shown_gap(gaps[-1], lm),
                         f"{p_full / p_low:.2f}x", *cells])
            section.sources += [str(full), str(puff)]
        if len(seeds) > 1:
            rows.append(["mean", "", "", shown_gap(statistics.mean(gaps), lm), "",
                         *[_mean_gap(methods, v, seeds) for v in variants]])
        plot_dir = out / exp
        compare_runs([str(methods[m][seeds[0]]) for m in ("full", "puff", "lowrank", "auto")
                      if seeds[0] in methods.get(m, {})], str(plot_dir))
        section.ours += [f"### {exp}", "", *markdown_table(
            ["seed", "full rank", "Pufferfish", "gap (points; LM: perplexity)", "fewer params",
             *[f"{VARIANTS[v]} (points)" for v in variants]], rows),
            "", f"![{exp}]({exp}/accuracy.png)", ""]
    section.ours = ["Pufferfish = the paper's recipe (momentum reset at the switch, ~10% "
                    "warm-up). Variants (docs/benchmarks.md): `--switch-momentum project`, "
                    "`--keep 'layer1.*'`, the warm-up to the first LR milestone, "
                    "`--warmup-epochs auto`; a mean is over the seeds that have the variant.", "",
                    *section.ours]
    if not section.sources:
        section.missing.append("python benchmarks/sweeps.py accuracy CONFIG OUT ...  # full and puff runs, see docs")
    return section


def _mean_gap(methods: dict[str, dict[int, Path]], variant: str, seeds: list[int]) -> str:
    """Mean gap of ``variant`` to full rank over the seeds that have it ("-" for under two)."""
    have = [s for s in seeds if s in methods.get(variant, {})]
    if len(have) < 2:
        return "-"
    lm = is_lm(methods["full"][have[0]])
    return shown_gap(statistics.mean(gap(methods[variant][s], methods["full"][s]) for s in have), lm)


def warmup(found: dict[str, dict[str, dict[int, Path]]]) -> Section:
    section = Section("Full-rank warm-up vs low rank from the start",
                      "the warm-up is worth +0.36 points on VGG-19 (CIFAR-10).")
    rows = []
    for exp, methods in found.items():
        for s in sorted(set(methods.get("puff", {})) & set(methods.get("lowrank", {}))):
            puff, low = methods["puff"][s], methods["lowrank"][s]
            lm = is_lm(puff)  # worth = lower perplexity, or higher accuracy
            rows.append([exp, str(s), shown(puff), shown(low),
                         shown_gap(-gap(puff, low) if lm else gap(puff, low), lm)])
            section.sources += [str(puff), str(low)]
    section.ours = markdown_table(["experiment", "seed", "with warm-up", "from the start",
                                   "warm-up worth"], rows)
    if not rows:
        section.missing.append("pufferfish train --mode lowrank ...  # beside a cached puff run")
    return section


def speed(found: dict[str, dict[str, dict[int, Path]]], cache: Path, out: Path) -> list[Section]:
    """Time to accuracy and per-step speed from cached bench results (re-plotted, not re-run)."""
    e2e = Section("End-to-end: time to full-rank accuracy",
                  "up to 1.64x end-to-end speedup over PyTorch DDP without accuracy loss.")
    steps = Section("Per step: Pufferfish vs gradient compression",
                    "Pufferfish is faster than PowerSGD and signSGD/Signum (no encoding work), "
                    "at full-rank accuracy.")
    for results in sorted(cache.glob("*/bench/results.json")):
        exp = results.parent.parent.name
        saved = json.loads(results.read_text())
        methods = found.get(exp, {})
        # One seed for all three: the first that has PowerSGD too, else the first full/puff pair.
        pair = set(methods.get("full", {})) & set(methods.get("puff", {}))
        seed = min(pair & set(methods.get("psgd", {})) or pair or {0})
        runs = {m: methods.get(k, {}).get(seed) for m, k in
                (("ddp", "full"), ("pufferfish", "puff"), ("powersgd", "psgd"),
                 ("pufferfish+powersgd", "puffpsgd"))}
        timed = {row["method"] for row in saved["rows"]}  # a run needs its method's step times
        runs = {m: r for m, r in runs.items() if r is not None and m in timed}
        if "ddp" not in runs:  # a bench of other experiments (e.g. DiLoCo's): no paper claim
            continue
        tta = out / f"{exp}-time"
        subprocess.run([sys.executable, "-m", "pufferfish", "bench", "--from-results", str(results),
                        "--accuracy-runs", ",".join(f"{m}={r}" for m, r in runs.items()),
                        "--compute-ms", str(saved["config"].get("compute_ms") or 30),
                        "--accuracy-processes", str(saved["config"].get("accuracy_processes", 0)),
                        "--out", str(tta), "--overwrite"],  # remade from the cache each time
                       check=True, capture_output=True, text=True)
        table = json.loads((tta / "results.json").read_text())["time_to_accuracy"]["measured"]
        rows = [[t["regime"], f"−{t['points_below']:g}", t["method"],
                 "never" if t["seconds"] is None else f"{t['seconds']:.0f} s",
                 "-" if t["speedup_vs_ddp"] is None else
                 f"{t['speedup_vs_ddp']:.2f}x [{t['speedup_worst']:.2f}–{t['speedup_best']:.2f}]"]
                for t in table["table"]]
        stopped = [f"`{r.parent.name}/{r.name}`{partial_note(r)}" for r in runs.values()
                   if partial_note(r)]
        e2e.ours += [f"### {exp} (seed {seed})", "", *markdown_table(
            ["link", "target (points below full)", "method", "time to target", "vs DDP"], rows),
            "", *([f"Stopped early: {', '.join(stopped)}; a target not reached by then reads "
                   "'never'.", ""] if stopped else []),
            f"![time to accuracy]({tta.name}/time_to_accuracy.png)", ""]
        e2e.sources += [str(results), *map(str, runs.values())]
        rows = [[r["bandwidth"], r["method"], f"{1000 * r['step_time']:.0f}",
                 f"{r['speedup_vs_ddp']:.2f}x [{r['spread']['speedup_vs_ddp'][0]:.2f}–"
                 f"{r['spread']['speedup_vs_ddp'][1]:.2f}]", f"{r['bytes_per_step'] / 1e6:.2f}"]
                for r in saved["rows"]]
        steps.ours += [f"### {exp}", "", *markdown_table(
            ["link", "method", "step ms (median)", "vs DDP [min–max over rounds]", "MB/step"],
            rows), ""]
        steps.sources.append(str(results))
        if "psgd" not in found.get(exp, {}):
            e2e.missing.append(f"pufferfish train ... --comm powersgd --out {cache}/{exp}/psgd-s0"
                               "  # PowerSGD's accuracy curve, for its time to accuracy")
    if not e2e.sources:
        e2e.missing.append("pufferfish bench ... --accuracy-runs ddp=...,pufferfish=... "
                           "# then copy results.json to <cache>/<experiment>/bench/")
    equal_budget(cache, e2e)
    return [e2e, steps]


def equal_budget(cache: Path, section: Section) -> None:
    """The demo's comparison beside the paper's speed-up: at the same wall-clock budget over a
    slow link, Pufferfish's faster epochs buy it more of them; the final accuracy gap per pair."""
    for folder in sorted(p for p in cache.iterdir() if p.is_dir()):
        runs = {(m["method"], int(m["epochs"]), int(m["seed"])): d for d in folder.iterdir()
                if (m := BUDGET_RUN.match(d.name)) and (d / "metrics.jsonl").is_file()}
        rows = []
        for e, n in EQUAL_BUDGET:
            seeds = sorted(s for k, ep, s in runs if (k, ep) == ("full", e) and ("puff", n, s) in runs)
            if not seeds:
                continue
            gaps = [final(runs["puff", n, s]) - final(runs["full", e, s]) for s in seeds]
            rows.append([str(e), str(n), ", ".join(f"{g:+.2f} (seed {s})" for g, s in zip(gaps, seeds)),
                         f"{statistics.mean(gaps):+.2f}"])
            section.sources += [str(runs[k, ep, s]) for s in seeds for k, ep in (("full", e), ("puff", n))]
        if rows:
            section.ours += [
                f"### {folder.name}: the same wall-clock budget over 100 Mbit/s (`make demo`)", "",
                "DDP trains E epochs, Pufferfish the N that fit in the same time over an emulated "
                "100 Mbit/s link (its first epoch full-rank; the step times: docs/benchmarks.md, "
                "\"The main job\"). Final test accuracy, Pufferfish minus DDP, in points:",
                "", *markdown_table(["DDP epochs", "Pufferfish epochs", "gap", "mean"], rows), ""]


def pruning(cache: Path) -> Section:
    section = Section("Against Lottery Ticket and structured pruning at equal size",
                      "as accurate as Lottery-Ticket models of the same size, without winning "
                      "the lottery; more accurate and smaller than structured pruning.")
    for table in sorted(cache.glob("*/compare/compare.md")):
        # compare.md opens with its own "# title": kept as a sentence under this section's heading
        body = table.read_text().split("\n\n![")[0].removeprefix("# ")
        section.ours += [f"### {table.parent.parent.name}", "", body, ""]
        section.sources.append(str(table))
    if not section.sources:
        section.missing.append("pufferfish compare --config configs/resnet18_fashion.toml "
                               "--width 0.25 --batch-size 64 --epochs 6 --warmup-epochs 1 "
                               f"--out {cache}/<experiment>/compare")
    return section


def headline(cache: Path, out: Path, params: dict[str, list[int]], source: str,
             plots: bool) -> list[dict]:
    """The README's claims (benchmarks/claims/): claims.json, readme-results.md, the plots."""
    claims, data = cl.build(cache, params, source)
    (out / "claims.json").write_text(json.dumps({"claims": claims}, indent=1) + "\n")
    (out / "readme-results.md").write_text("\n".join(cl.readme_table(claims)) + "\n")
    (out / "readme-not-met.md").write_text(cl.readme_not_met(claims) + "\n")
    if plots:
        claim_plots.plot_tta(data["tta"], ["1gbit", "100mbit"], "ResNet-18 width 1.0, 2 workers: "
                             "seed 0 solid, seed 1 dashed", out / "tta-w1.png")
        if data["ranks"]:  # once the image sweep's benches are cached
            claim_plots.plot_tta(data["ranks"], ["loopback", "1gbit", "100mbit"],
                                 "ResNet-18 width 0.25, 20 epochs, 2 workers, DDP and each side's "
                                 "picks: seed 0 solid, seed 1 dashed", out / "ranks-w025.png")
        claim_plots.plot_diloco(data["diloco"], out / "diloco-llama.png")
        budget = folders.folder(cache, "lm-budget")
        if budget.is_dir():
            import lm_budget
            lm_budget.summary(budget, out / "lm-budget.md", out / "lm-budget.png")
    return claims


def claims_markdown(claims: list[dict]) -> list[str]:
    """report.md's first section: every headline claim with its seeds, target and limits."""
    lines = ["## Headline claims (README.md's table; `claims.json`)", "",
             "A target is met only when it holds on every seed (for times, in the bench's worst "
             "round); spread = max − min over seeds.", ""]
    for c in claims:
        lines += [f"### {c['title']}", "", f"**Paper:** {c['paper']}. **Target:** {c['target']}:"
                  f" {'met' if c['met'] else 'not run yet' if c['met'] is None else 'not met'}. "
                  f"**Chosen on:** {c['chosen_on']}.", ""]
        rows = [[m, ", ".join(f"s{s}: {'never' if v is None else f'{v:.4g}'}"
                              for s, v in e["seeds"].items()) or "-",
                 "-" if e.get("mean") is None else f"{e['mean']:,.6g}",
                 "-" if e.get("spread") is None else f"{e['spread']:.3g}"]
                for m, e in c["methods"].items() if "seeds" in e]
        lines += [*markdown_table(["method", "per seed", "mean", "spread"], rows), ""]
        lines += [f"- {n}" for n in c["notes"]] + [f"- Does not show: {c['limits']}",
                                                   f"- Command: `{c['command']}`", ""]
    return lines


def replace_results_table(readme: Path, table: str, not_met: str) -> None:
    """The table under README's ``## Results`` replaced by ``table``, and its sentence of the
    claims not met by ``not_met`` (written via a temp file)."""
    head, sep, rest = readme.read_text().partition("\n## Results\n")
    if not sep:
        raise SystemExit(f"paper: {readme} has no '## Results' section")
    if not cl.NOT_MET.search(rest):
        raise SystemExit(f"paper: {readme} has no '<!-- not met: ... -->' sentence under Results")
    lines = rest.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rest = "\n".join([*lines[:start], table.rstrip("\n"), *lines[end:]])
    write_in_place(readme, head + sep + cl.NOT_MET.sub(lambda _: not_met, rest, count=1))


def write_in_place(path: Path, text: str) -> None:
    """``path`` replaced by ``text`` via a temporary file beside it (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="where everything goes (same as --out)")
    ap.add_argument("--cache", default=str(folders.CACHE), help="folder of cached runs")
    ap.add_argument("--out", default="runs/paper", help="where report.md and its plots go")
    ap.add_argument("--counts", default="live", metavar="live|FILE",
                    help="parameter counts: computed now (live, minutes on a busy CPU), or read "
                         "from an earlier param-counts.json")
    ap.add_argument("--claims-only", action="store_true",
                    help="only claims.json, readme-results.md and report.md's claims (seconds)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    ap.add_argument("--docs-img", default="", metavar="DIR",
                    help="also copy the headline plots there (docs/img)")
    ap.add_argument("--readme", default="", metavar="FILE",
                    help="also put the Results table into this README (README.md) in place")
    ap.add_argument("--docs", default="", metavar="FILE",
                    help="also rewrite the claim blocks of this file (docs/benchmarks.md) in place")
    args = ap.parse_args(argv)
    cache, out = Path(args.cache), Path(args.out_dir or args.out)
    if not cache.is_dir():
        print(f"paper: cache {str(cache)!r} is not a directory: allowed a folder of runs "
              "(default benchmarks/results)", file=sys.stderr)
        return 2
    if args.counts != "live" and not Path(args.counts).is_file():
        print(f"paper: --counts {args.counts!r} is not a file: allowed live or a "
              "param-counts.json", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    count_section, params, source = counts(args.counts, out)
    claims = headline(cache, out, params, source, not args.no_plots)
    if args.docs_img:
        Path(args.docs_img).mkdir(parents=True, exist_ok=True)
        ranks = ["ranks-w025.png"] if (out / "ranks-w025.png").is_file() else []  # once benched
        for name in ("tta-w1.png", *ranks, "diloco-llama.png"):
            shutil.copyfile(out / name, Path(args.docs_img) / name)
    if args.readme:
        replace_results_table(Path(args.readme), (out / "readme-results.md").read_text(),
                              (out / "readme-not-met.md").read_text().strip())
    if args.docs:
        write_in_place(Path(args.docs), cl.replace_docs_blocks(Path(args.docs).read_text(), claims))
    lines = ["# Pufferfish: the paper's claims beside ours", "",
             f"Regenerated by `benchmarks/paper.sh --cache {cache} --out {out}`.", "",
             "**What differs.** " + WHAT_DIFFERS, "", *claims_markdown(claims)]
    sections = [count_section]
    if not args.claims_only:
        found = experiments(cache)
        sections += [parity(found, out), warmup(found), *speed(found, cache, out), pruning(cache)]
    for s in sections:
        lines += s.markdown()
    (out / "report.md").write_text("\n".join(lines))
    missing = sum(bool(s.missing) for s in sections)
    print(f"written: {out / 'report.md'}, claims.json ({len(claims)} claims), "
          f"readme-results.md ({len(sections)} report sections, {missing} with runs missing "
          "from the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
