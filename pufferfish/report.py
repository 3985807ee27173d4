"""``pufferfish report``: runs side by side, as Markdown and plots.

Reads each run directory's ``metrics.jsonl`` and ``config.toml``; writes nothing into the runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path
from typing import Any

from .formatting import markdown_table
from .outputs import claim_outputs, hold, seal_outputs
from .training.checkpoint import atomic_write
from .training.metrics import quality_key, read_metrics, selection_key

__all__ = ["compare_runs", "summarize_run"]


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The figures a comparison needs from one run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist: allowed the "
                                "--out directory of a `pufferfish train` run")
    if not (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no finished epoch: the run "
                                "stopped before its first epoch ended (config.toml, no "
                                "metrics.jsonl); nothing to report")
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no metrics.jsonl: not a "
                                "`pufferfish train` run directory")
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no finished epoch yet "
                                "(metrics.jsonl is empty)")
    cfg_path = run_dir / "config.toml"
    cfg = tomllib.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    last = rows[-1]
    key, choose = quality_key(last), selection_key(last)
    scored = [r for r in rows if choose in r]
    # The best epoch as one would choose it: on the validation split where the run has one.
    best = (max if choose.endswith("_acc") else min)(scored, key=lambda r: r[choose])
    low = [r for r in rows if r.get("lowrank")]
    full = [r for r in rows if not r.get("lowrank")]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs) if rs else None  # noqa: E731
    return {
        "run": run_dir.name,
        "mode": cfg.get("mode", "?"),
        "comm": cfg.get("comm", "?"),
        "epochs": last["epoch"],
        "quality_key": key,
        "final": last[key],
        "selection_key": choose,
        "best_epoch": best["epoch"],
        "best": best[choose],
        "params": last["params"],
        "macs": last["macs"],
        "epoch_time": mean(rows, "epoch_time"),
        "epoch_time_full": mean(full, "epoch_time"),
        "epoch_time_lowrank": mean(low, "epoch_time"),
        "total_time": sum(r["epoch_time"] for r in rows),
        "bytes_per_step": last.get("comm_bytes_per_step", 0.0),
        "switch_epoch": last.get("switch_epoch"),
        "stable_rank_history": _stable_rank_history(run_dir),
        "rows": rows,
    }


def _stable_rank_history(run_dir: Path) -> dict[str, list[list[float]]] | None:
    """Every stable-rank observation of an automatic run (several per epoch), if it switched."""
    path = run_dir / "factorization.json"
    if not path.exists():
        return None
    decisions = json.loads(path.read_text()).get("decisions") or {}
    return (decisions.get("stable_ranks") or {}).get("history")


REPORT_FILES = ("report.md", "accuracy.png", "stable_ranks.png")


def compare_runs(run_dirs: list[str], out: str | None = None, *, overwrite: bool = False,
                 command: str = "report", held: bool = False) -> str:
    """A Markdown table of the runs; with ``out``, also ``report.md`` and PNG plots there
    (refused if they would replace files that ``command`` did not write, or that were changed
    since, unless ``overwrite``; ``out`` held while written unless the caller ``held`` it
    already). Everything is made first: a failure writes nothing."""
    runs = [summarize_run(d) for d in run_dirs]
    table = "\n".join(markdown_table(*_table(runs)))
    if not out:
        return table
    out_dir = Path(out)
    plots = _plot(runs)
    body = table + "\n\n" + "\n".join(f"![{Path(n).stem}]({n})" for n in plots) + "\n"
    files = {"report.md": body.encode(), **plots}
    with contextlib.nullcontext() if held else hold(out_dir, command):
        claim_outputs(out_dir, command, REPORT_FILES, overwrite)
        for name, data in files.items():
            atomic_write(out_dir / name, lambda f, data=data: f.write(data))
        seal_outputs(out_dir, command, files)
    return table + "\n\nwritten: " + ", ".join(str(out_dir / name) for name in files)


def _quality(run: dict[str, Any], named: bool) -> str:
    """A run's final quality by its own key: ``91.20%`` (accuracy) or ``206.62`` (perplexity);
    ``named``: followed by the key (``val ppl``), for a table of runs of different tasks."""
    key = run["quality_key"]
    text = f"{100 * run['final']:.2f}%" if key == "test_acc" else f"{run['final']:.2f}"
    return f"{text} {key.replace('_', ' ')}" if named else text


def _table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    keys = {r["quality_key"] for r in runs}
    mixed = len(keys) > 1  # e.g. a language model beside an image model: each by its own key
    quality = "final quality" if mixed else f"final {keys.pop().replace('_', ' ')}"
    head = ["run", "mode", "comm", "epochs", quality, "params", "MACs", "s/epoch",
            "s/epoch after switch", "total s", "MB/step", "time vs first"]
    base = runs[0]
    rows = []
    for r in runs:
        after = r["epoch_time_lowrank"]
        rows.append([
            r["run"], r["mode"], r["comm"], str(r["epochs"]), _quality(r, mixed),
            f"{r['params'] / 1e6:.3f}M", f"{r['macs'] / 1e6:.1f}M", f"{r['epoch_time']:.1f}",
            f"{after:.1f}" if after is not None else "-", f"{r['total_time']:.0f}",
            f"{r['bytes_per_step'] / 1e6:.2f}",
            f"{r['total_time'] / base['total_time']:.2f}x",
        ])
    return head, rows


LABELS = {"test_ppl": "test perplexity", "val_ppl": "validation perplexity",
          "test_acc": "test accuracy"}


def _curve_key(run: dict[str, Any]) -> str:
    """The figure a run's curve shows: its reported one if every epoch has it, else the one
    choices are made on (llama's test perplexity exists after the last epoch only)."""
    key = run["quality_key"]
    return key if all(key in row for row in run["rows"]) else run["selection_key"]


def _plot(runs: list[dict[str, Any]]) -> dict[str, bytes]:
    """``{file name: PNG}``: quality per epoch and against time (a row per quality key, so
    accuracy and perplexity never share an axis), and the stable ranks where recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(_curve_key(r) for r in runs))
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 4 * len(keys)), squeeze=False)
    for key, (ax_epoch, ax_time) in zip(keys, axes):
        label = LABELS.get(key, key)
        for r in (r for r in runs if _curve_key(r) == key):
            epochs = [row["epoch"] for row in r["rows"]]
            values = [row[key] for row in r["rows"]]
            clock, t = [], 0.0
            for row in r["rows"]:
                t += row["epoch_time"]
                clock.append(t)
            name = f"{r['run']} ({r['mode']})"
            ax_epoch.plot(epochs, values, marker="o", label=name)
            ax_time.plot(clock, values, marker="o", label=name)
            if r["switch_epoch"] is not None and r["switch_epoch"] > 0:
                ax_epoch.axvline(r["switch_epoch"] + 0.5, ls=":", color="grey")
        ax_epoch.set(xlabel="epoch", ylabel=label, title=f"{label} per epoch")
        ax_time.set(xlabel="wall-clock seconds", ylabel=label, title=f"{label} against time")
        for ax in (ax_epoch, ax_time):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    plots = {"accuracy.png": _png(fig, plt)}
    stable = [r for r in runs if any("stable_ranks" in row for row in r["rows"])]
    if stable:
        plots["stable_ranks.png"] = _plot_stable_ranks(stable[0], plt)
    return plots


def _png(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _plot_stable_ranks(run: dict[str, Any], plt: Any) -> bytes:
    """Stable rank per layer over epochs: every observation where the run recorded them
    (``factorization.json``, from initialization to the switch), else the per-epoch rows."""
    series: dict[str, list[tuple[float, float]]] = {}
    if run.get("stable_rank_history"):
        series = {name: [(t, v) for t, v in points]
                  for name, points in run["stable_rank_history"].items()}
    else:
        for row in run["rows"]:
            for name, value in (row.get("stable_ranks") or {}).items():
                series.setdefault(name, []).append((row["epoch"], value))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        ax.plot(*zip(*points), label=name, lw=1)
    if run["switch_epoch"]:
        ax.axvline(run["switch_epoch"], ls=":", color="grey", label="switch")
    ax.set(xlabel="epoch", ylabel="stable rank", title=f"stable rank per layer: {run['run']}")
    if len(series) <= 12:
        ax.legend(fontsize=6)
    fig.tight_layout()
    return _png(fig, plt)
