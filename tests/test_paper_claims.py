"""benchmarks/paper.sh's headline claims: README.md's Results table and docs/benchmarks.md's claim
blocks are the generated ones, and claims.json has every field, from the cache (parameter counts
read from the cached file: counting them live takes minutes on a busy CPU; paper.sh computes them
live); each claim says only what was measured, at the resolution it was measured."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pufferfish.models.llama import LLAMA_LR_MEASURED

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import claims as cl  # noqa: E402  (benchmarks/ is not a package)
import folders  # noqa: E402
from claims import images  # noqa: E402

KEYS = {"id", "title", "paper", "unit", "target", "met", "methods", "command", "sources",
        "limits", "chosen_on"}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("paper")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/paper.py"), str(out), "--cache",
         "benchmarks/results", "--counts",
         "benchmarks/results/param-counts.json", "--claims-only", "--no-plots"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return out


def readme_table() -> str:
    lines = (ROOT / "README.md").read_text().split("\n## Results\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end]) + "\n"


def test_the_readme_table_is_the_generated_one(generated: Path) -> None:
    assert readme_table() == (generated / "readme-results.md").read_text(), (
        "README.md's Results table differs from benchmarks/paper.sh's readme-results.md: "
        "regenerate it: benchmarks/paper.sh OUT --readme README.md")


def test_the_readme_says_which_claims_are_not_met_as_generated(generated: Path) -> None:
    """The sentence under the table names the claims not met and pending from claims.json;
    each claim has a name there."""
    sentence = (generated / "readme-not-met.md").read_text().strip()
    assert sentence in (ROOT / "README.md").read_text(), (
        "README.md's not-met sentence differs: regenerate it: benchmarks/paper.sh OUT --readme "
        "README.md")
    claims = json.loads((generated / "claims.json").read_text())["claims"]
    for c in claims:
        assert (cl.SHORT[c["id"]] in sentence) == (c["met"] is not True), c["id"]


def test_every_claim_has_its_fields_seeds_and_limits(generated: Path) -> None:
    claims = json.loads((generated / "claims.json").read_text())["claims"]
    assert len({c["id"] for c in claims}) == len(claims) >= 9
    for c in claims:
        assert set(c) >= KEYS, c["id"]
        # nothing chosen on the split it reports is a claim (the LSTM and llama ½ stay in docs)
        assert c["limits"] and c["chosen_on"] in {"validation", "fixed in advance",
                                                    "fixed in advance (the paper's recipe; "
                                                    "target from the issue)"}, c["id"]
        for name, entry in c["methods"].items():
            if "seeds" in entry:
                assert {"mean", "spread"} <= set(entry), (c["id"], name)


def measured_widths() -> str:
    """How the claim and the README name the widths llama's defaults were measured at: the
    product's own list (tests/test_lm_budget_driver.py holds that list to the cache)."""
    widths = [f"{w:g}" for w in sorted(LLAMA_LR_MEASURED)]
    return (f"width {widths[0]} only" if len(widths) == 1
            else f"widths {', '.join(widths[:-1])} and {widths[-1]}")


def by_id(generated: Path) -> dict[str, dict]:
    return {c["id"]: c for c in json.loads((generated / "claims.json").read_text())["claims"]}


def test_docs_claim_blocks_are_the_generated_ones(generated: Path) -> None:
    """Every number docs/benchmarks.md reports for a claim is claims.json's: its blocks are
    rendered from the records, one per claim."""
    claims = json.loads((generated / "claims.json").read_text())["claims"]
    docs = (ROOT / "docs/benchmarks.md").read_text()
    assert cl.replace_docs_blocks(docs, claims) == docs, (
        "docs/benchmarks.md's claim blocks differ from claims.json: regenerate them: "
        "benchmarks/paper.sh OUT --docs docs/benchmarks.md")
    assert [m["id"] for m in cl.BLOCK.finditer(docs)] and all(
        c["readme"]["ours"] in docs for c in claims)


def test_a_block_without_its_claim_is_refused() -> None:
    text = "<!-- claim: gone -->\nold\n<!-- /claim -->\n"
    with pytest.raises(SystemExit, match="gone"):
        cl.replace_docs_blocks(text, [])


def test_powersgd_seed_0_is_its_stopped_fp32_run(generated: Path) -> None:
    """Seed 0's PowerSGD run at the paper's width (psgdfp32-s0) is used, and the row says it
    stopped before the target instead of calling seed 0 missing."""
    tta = by_id(generated)["time-to-accuracy"]
    assert tta["methods"]["powersgd"]["seeds"] == {"0": None, "1": pytest.approx(3.11, abs=0.01)}
    assert "psgdfp32-s0" in tta["readme"]["ours"] and "13 epochs" in tta["readme"]["ours"]
    assert not tta["notes"]


def test_the_ranks_prose_quotes_the_claims_times(generated: Path) -> None:
    """docs/benchmarks.md's prose beside the each-at-its-best claim compares DDP with Pufferfish
    per seed: its seconds are claims.json's."""
    claim = by_id(generated)["baselines-at-best"]
    text = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    for name, margin in (("DDP", "0.5"), ("Pufferfish (rank ½)", "0.5"), ("DDP", "1"),
                         ("Pufferfish (rank ¼)", "1")):
        seeds = claim["methods"][f"{name}: s to DDP −{margin}"]["seeds"]
        assert f"{seeds['0']:,.0f} / {seeds['1']:,.0f} s" in text, (name, margin, seeds)


def test_a_first_within_the_rounds_spread_is_a_tie(generated: Path) -> None:
    """The LM-over-links row by the README's rule: over 100 Mbit/s the first method's worst
    round overlaps its nearest rival's best, so it is not met; the baselines that never reach the
    target are named at the settings chosen on validation (the bench's rank and H)."""
    import lm_links

    links = by_id(generated)["lm-budget-links"]
    assert links["met"] is False
    ours = links["readme"]["ours"]
    assert "100 Mbit/s: first ddp" in ours and "against svd-init's" in ours and "a tie" in ours
    flags = lm_links.bench_flags(ROOT / "benchmarks" / "results" / "lm-budget")
    assert flags is not None
    rank, inner = flags[flags.index("--powersgd-rank") + 1], flags[flags.index("--inner-steps") + 1]
    assert f"svd-init+powersgd (rank {rank})" in ours and f"diloco (H = {inner}," in ours
    assert "SVD-initialized low rank" in ours  # named by what it ran, not "a one-step warm-up"


def test_the_budget_claim_is_at_the_tuned_budget_with_its_resolution(generated: Path) -> None:
    budget = by_id(generated)["lm-budget"]
    assert all("@" not in name for name in budget["methods"])  # 20 tokens/param only
    assert set(budget["methods"]) >= {"full", "lowrank"}
    ours = budget["readme"]["ours"]
    match = re.search(r"differences under ([\d.]+) ppl \((\d+)% of full rank's\)", ours)
    full, low = budget["methods"]["full"], budget["methods"]["lowrank"]
    bar = 2 * max(full["spread"], low["spread"])
    assert match and float(match[1]) == pytest.approx(bar, abs=0.01)
    assert int(match[2]) == round(100 * bar / full["mean"])
    assert "not tuned" in ours and measured_widths() in budget["limits"]


def test_one_demo_row_from_the_current_demo(generated: Path) -> None:
    claims = by_id(generated)
    assert [i for i in claims if "demo" in i] == ["demo"]
    sources = claims["demo"]["sources"]
    assert sources and all("demo-picks-2026-12-08" in s for s in sources)


def test_the_demo_row_names_the_methods_the_demo_ran_with_their_settings(
        tmp_path: Path) -> None:
    """A demo run at the image study's settings (``powersgd:rank=1``,
    ``pufferfish:rank_ratio=0.125``): the cached demo, its methods renamed."""
    demo = folders.folder(tmp_path, "demo")
    shutil.copytree(folders.folder(ROOT / folders.CACHE, "demo"), demo)
    names = {"powersgd": "powersgd:rank=1", "pufferfish": "pufferfish:rank_ratio=0.125"}
    for old, new in names.items():
        (demo / "train" / "100mbit" / old).rename(demo / "train" / "100mbit" / new)
    results = json.loads((demo / "train_results.json").read_text())
    for run in results["runs"]:
        run["method"] = names.get(run["method"], run["method"])
    (demo / "train_results.json").write_text(json.dumps(results))
    ours = images.demo_claim(tmp_path)["readme"]["ours"]
    assert "powersgd:rank=1 295 s (88.40%, 4 epochs)" in ours, ours
    assert "first: pufferfish:rank_ratio=0.125; Pufferfish 1.74x fewer parameters" in ours


def test_the_cached_demo_ran_at_the_image_sweeps_picks() -> None:
    """`make demo`'s row comes from a demo at ``image_ranks.settings``' picks, PowerSGD
    compressing from 10% of its steps as in the sweep, and its row says so. A tripwire too: when
    newly cached sweep runs change the picks, this fails until the demo is run again."""
    import image_ranks

    cache = ROOT / folders.CACHE
    picks = image_ranks.settings(folders.folder(cache, "image-ranks"))
    assert isinstance(picks, dict), picks
    runs = folders.folder(cache, "demo") / "train" / "100mbit"
    for name in ("powersgd", "pufferfish+powersgd"):
        cfg = cl.config_of(runs / name)
        assert cfg["powersgd_rank"] == picks["powersgd_rank"], name
        steps = cfg["train_subset"] // 128 * cfg["epochs"]
        assert cfg["powersgd_start_iter"] == -(-steps // 10), name
    for name in ("pufferfish", "pufferfish+powersgd"):
        assert float(cl.config_of(runs / name)["rank_ratio"]) == float(picks["rank_ratio"]), name
    so_far = " so far" if image_ranks.pending(folders.folder(cache, "image-ranks")) else ""
    assert f"(the image sweep's picks{so_far})" in images.demo_claim(cache)["readme"]["ours"]


def _demo_copy(tmp_path: Path) -> Path:
    """The cached demo copied under ``tmp_path`` (a cache of its own, the image sweep linked)."""
    cache = ROOT / folders.CACHE
    demo = folders.folder(tmp_path, "demo")
    shutil.copytree(folders.folder(cache, "demo"), demo)
    folders.folder(tmp_path, "image-ranks").symlink_to(folders.folder(cache, "image-ranks"))
    return demo


@pytest.mark.parametrize("run,setting,value", [
    ("powersgd", "powersgd_rank", "3"), ("pufferfish+powersgd", "powersgd_rank", "3"),
    ("powersgd", "powersgd_start_iter", "2"), ("pufferfish", "rank_ratio", '"0.25"'),
    ("pufferfish+powersgd", "rank_ratio", '"auto"')])
def test_a_demo_at_other_settings_says_it_is_not_at_the_sweeps_picks(
        tmp_path: Path, run: str, setting: str, value: str) -> None:
    """Any of its runs at another rank, start step or rank ratio than the sweep's picks."""
    config = _demo_copy(tmp_path) / "train" / "100mbit" / run / "config.toml"
    text, n = re.subn(rf"(?m)^{setting} = .*$", f"{setting} = {value}", config.read_text())
    assert n == 1
    config.write_text(text)
    ours = images.demo_claim(tmp_path)["readme"]["ours"]
    assert "(not the image sweep's picks: PowerSGD rank" in ours, ours


def test_the_demo_row_names_the_machine_its_record_names(tmp_path: Path) -> None:
    results = _demo_copy(tmp_path) / "train_results.json"
    record = json.loads(results.read_text())
    assert "does not name" in images.demo_claim(tmp_path)["limits"] or "machine" in record
    record["machine"] = {"cpu": "Some CPU 9000", "gpu": "Some GPU"}
    results.write_text(json.dumps(record))
    limits = images.demo_claim(tmp_path)["limits"]
    assert "on one machine: CPU (Some CPU 9000), GPU (Some GPU)." in limits, limits


def test_the_prose_states_the_budget_rules_resolution_as_claimed(generated: Path) -> None:
    """README's "Beyond the paper", docs/benchmarks.md and docs/usage.md word the budget study's
    verdict with the resolution the claim reports: every "differences under N%" / "under X ppl" is
    claims.json's."""
    ours = by_id(generated)["lm-budget"]["readme"]["ours"]
    bar, pct = re.search(r"under ([\d.]+) ppl \((\d+)% of full rank's\)", ours).groups()
    readme = " ".join((ROOT / "README.md").read_text().split("## Beyond the paper", 1)[1].split())
    docs = " ".join(" ".join((ROOT / f"docs/{name}.md").read_text()
                             for name in ("benchmarks", "usage")).split())
    assert f"differences under {pct}%" in readme and measured_widths() in readme
    assert f"inside the rule's {pct}%" in readme  # width 0.25's gaps against the same resolution
    said = re.findall(r"differences under (\d+)%", readme + docs)
    assert len(said) >= 4 and set(said) == {pct}
    assert set(re.findall(r"differences under ([\d.]+) ppl", docs)) == {bar}


def test_the_readme_quotes_the_width_study_s_verdict() -> None:
    """README's and docs/usage.md's llama sentences give each low-rank method's distance to full
    rank at width 0.25 and that width's own seed spread as benchmarks/lm_width.py computes them
    from the cache, or say the study is pending."""
    import lm_width

    cache = ROOT / "benchmarks" / "results" / "lm-budget"
    found = lm_width.verdict(cache)
    readme = " ".join((ROOT / "README.md").read_text().split("## Beyond the paper", 1)[1].split())
    if found is None:
        assert "width 0.25 pending" in readme
        return
    full = found["vals"]["full"][0]
    low, puff = (round(100 * (found["vals"][m][0] / full - 1)) for m in ("lowrank", lm_width.PUFF))
    spread = max(lm_width.own_spread(cache, m, found["lrs"][m]) or 0.0 for m in ("full", "lowrank"))
    seeds = found["vals"][lm_width.PUFF][1]
    said = {1: "one seed", 2: "two seeds", 3: "three seeds"}[seeds]
    assert (f"trails it by {low}% at 0.25 (Pufferfish's 10% switch by {puff}%, {said}), where "
            f"full and low rank's seeds lie within {spread:.1%}") in readme
    usage = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    assert (f"{low}% behind full rank at 0.25 (Pufferfish's 10% switch {puff}%, {said}; full and "
            f"low rank's seeds there within {spread:.1%})") in usage


def test_the_lm_prose_quotes_the_claims_figures(generated: Path) -> None:
    """docs/benchmarks.md's prose around the LM budget and links claims repeats claims.json's
    means, spreads and seconds, not typed ones."""
    claims = by_id(generated)
    docs = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    budget = claims["lm-budget"]["methods"]
    full, low, svd = (budget[m] for m in ("full", "lowrank", "puff1step"))
    said = [f"full rank {full['mean']:.2f}, low rank from the start {low['mean']:.2f}",
            f"low rank from the start {low['mean']:.2f} (spread {low['spread']:.2f}), `puff1step` "
            f"{svd['mean']:.2f} ({svd['spread']:.2f}), full rank {full['mean']:.2f} "
            f"({full['spread']:.2f})",
            f"twice full rank's spread of {full['spread']:.2f}"]
    links = claims["lm-budget-links"]
    said += [f"({_secs(links, 'ddp: s to target @ 100mbit')} against the SVD-initialized low "
             f"rank's {_secs(links, 'pufferfish: s to target @ 100mbit')}",
             f"({_secs(links, 'pufferfish: s to target @ 10mbit')} against DDP's "
             f"{_secs(links, 'ddp: s to target @ 10mbit')}"]
    for text in said:
        assert text in docs, text


def _speed(claim: dict, method: str, seed: str) -> str:
    """'2.35x [2.27–2.50]': a speed-up over DDP with its worst and best bench rounds."""
    entry = claim["methods"][method]
    worst, best = entry["rounds"][seed]
    return f"{entry['seeds'][seed]:.2f}x [{worst:.2f}–{best:.2f}]"


def _secs(claim: dict, method: str, seed: str = "0") -> str:
    return f"{claim['methods'][method]['seeds'][seed]:,.0f} s"


# docs/benchmarks.md's tables outside the claim blocks that quote a claim's figure: a row's start,
# the claim, and the figure as claims.json gives it
QUOTES = [
    ("| 100 Mbit/s | Pufferfish |", "time-to-accuracy", lambda c: _speed(c, "pufferfish", "1")),
    ("| 100 Mbit/s | PowerSGD |", "time-to-accuracy", lambda c: _speed(c, "powersgd", "1")),
    ("| DDP | 3 |", "demo", lambda c: _secs(c, "ddp")),
    ("| PowerSGD (rank 4) | 4 |", "demo", lambda c: _secs(c, "powersgd")),
    ("| Pufferfish (rank ½) | 4 |", "demo", lambda c: _secs(c, "pufferfish")),
    ("| Pufferfish (rank ½) + PowerSGD", "demo", lambda c: _secs(c, "pufferfish+powersgd")),
    ("The verdict: **Pufferfish reaches", "demo", lambda c: f"({_secs(c, 'pufferfish')}, at"),
    ("DDP's 271 s, Pufferfish + PowerSGD's", "demo",
     lambda c: f"DDP's {_secs(c, 'ddp')}, Pufferfish + PowerSGD's "
               f"{_secs(c, 'pufferfish+powersgd')} and PowerSGD's {_secs(c, 'powersgd')}"),
    ("| ddp (lr 0.01) |", "lm-budget-links", lambda c: _secs(c, "ddp: s to target @ 100mbit")),
    ("| ddp (lr 0.01) |", "lm-budget-links", lambda c: _secs(c, "ddp: s to target @ 10mbit")),
    ("| pufferfish (lr 0.01) |", "lm-budget-links",
     lambda c: _secs(c, "pufferfish: s to target @ 100mbit")),
    ("| pufferfish (lr 0.01) |", "lm-budget-links",
     lambda c: _secs(c, "pufferfish: s to target @ 10mbit")),
]


@pytest.mark.parametrize("start,cid,quote", QUOTES,
                         ids=[f"{cid}-{i}" for i, (_, cid, _) in enumerate(QUOTES)])
def test_the_docs_tables_quote_the_claims_figures(generated: Path, start: str, cid: str,
                                                  quote: Callable[[dict], str]) -> None:
    """A measurement table that repeats a claim's figure repeats claims.json's, not a stale one."""
    figure = quote(by_id(generated)[cid])
    rows = [line for line in (ROOT / "docs/benchmarks.md").read_text().splitlines()
            if line.startswith(start)]
    assert any(figure in row for row in rows), (cid, figure, rows)
