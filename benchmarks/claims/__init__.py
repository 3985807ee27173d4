"""The headline claims: every number of README.md's Results table, computed from the cache.

One package, by topic: this module holds the rules (runs, seeds, spreads, records, the README
table and the claim blocks of docs/benchmarks.md); ``images.py`` the image-model claims
(parameters, accuracy, warm-up, time to accuracy, each baseline at its best (composed or not),
``make demo``); ``lm.py`` the language-model ones (DiLoCo, the budget study and its links);
``plots.py`` the plots.

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
import re
import statistics
import tomllib
from pathlib import Path
from typing import Any

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


def config_of(run: Path) -> dict[str, Any]:
    """The run's configuration as it ran (its config.toml)."""
    return tomllib.loads((run / "config.toml").read_text())


def planned_epochs(run: Path) -> int:
    """The epochs the run was configured for (a run stopped early has fewer rows)."""
    return int(config_of(run)["epochs"])


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
    return {True: "**met**", False: "**not met**", None: "pending"}[met]


# What README's sentence under the table calls each claim (by id).
SHORT = {"parameters": "the parameter counts", "accuracy-gap": "the accuracy gap",
         "warm-up": "the warm-up", "time-to-accuracy": "time to accuracy",
         "baselines-at-best": "Pufferfish vs PowerSGD each at its best",
         "demo": "`make demo`", "diloco": "DiLoCo", "lm-budget": "the LM budget study",
         "lm-budget-links": "the LM budget study over links"}
NOT_MET = re.compile(r"<!-- not met: generated by benchmarks/paper\.sh -->.*?<!-- /not met -->",
                     re.S)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]


def readme_not_met(claims: list[dict]) -> str:
    """README's sentence under the table: the claims not met and those pending, by name."""
    said = []
    for met, what in ((False, "Not met (2 CPU processes, emulated links): {}, each with its "
                               "reason above"), (None, "pending (their runs not all cached): {}")):
        names = [SHORT[c["id"]] for c in claims if c["met"] is met]
        if names:
            said.append(what.format(_listed(names)))
    text = "; ".join(said) + "." if said else "Every claim is met."
    return f"<!-- not met: generated by benchmarks/paper.sh -->{text}<!-- /not met -->"


def readme_table(claims: list[dict]) -> list[str]:
    """README.md's Results table: one row per claim, every number from ``claims``."""
    lines = ["| | the paper | pufferfish | target | details |", "|---|---|---|---|---|"]
    for c in claims:
        r = c["readme"]
        target = f"{c['target']}: {_met_word(c['met'])}"
        lines.append(f"| {r['row']} | {r['paper']} | {r['ours']} | {target} | {r['details']} |")
    return lines


# -- the claims' blocks in docs/benchmarks.md ------------------------------------------------------

BLOCK = re.compile(r"(<!-- claim: (?P<id>[\w-]+) [^\n]*-->\n)(?P<body>.*?)(<!-- /claim -->)", re.S)
BLOCK_HEAD = "<!-- claim: {id} (generated by benchmarks/paper.sh from claims.json: edit claims/) -->"


def docs_block(claim: dict) -> str:
    """A claim as docs/benchmarks.md shows it: what we measured, the target and its verdict, what
    it does not show; the same words and numbers as the README's row and claims.json."""
    lines = [f"**The claim** ({claim['title']}): {claim['readme']['ours']}.",
             f"**Target:** {claim['target']}: {_met_word(claim['met'])}.",
             f"**Does not show:** {claim['limits']}"]
    lines += [f"**Note:** {n}." for n in claim["notes"]]
    return "\n\n".join(lines) + "\n"


def replace_docs_blocks(text: str, claims: list[dict]) -> str:
    """``text`` with every claim block rewritten from ``claims``; a block whose claim is gone, or
    a claim without a block, is an error (the docs would quote a number no claim reports)."""
    by_id = {c["id"]: c for c in claims}
    found = [m["id"] for m in BLOCK.finditer(text)]
    unknown, absent = set(found) - set(by_id), set(by_id) - set(found)
    if unknown or absent:
        raise SystemExit(f"paper: docs claim blocks {sorted(unknown)} have no claim, claims "
                         f"{sorted(absent)} have no block: allowed one block per claim id")
    return BLOCK.sub(lambda m: BLOCK_HEAD.format(id=m["id"]) + "\n" + docs_block(by_id[m["id"]])
                     + m[4], text)


def build(cache: Path, params: dict[str, list[int]], source: str) -> tuple[list[dict], dict]:
    """Every headline claim in the README's order, and the data of the plots."""
    from claims import images, lm

    tta, tta_curves = images.tta_claim(cache)
    ranks, ranks_curves = images.ranks_claim(cache)
    diloco, diloco_data = lm.diloco_claim(cache)
    claims = [images.counts_claim(params, source), images.accuracy_claim(cache),
              images.warmup_claim(cache), tta, ranks,
              images.demo_claim(cache), diloco,
              lm.budget_claim(cache), lm.budget_links_claim(cache)]
    return claims, {"tta": tta_curves, "ranks": ranks_curves, "diloco": diloco_data}


