"""``pufferfish compare``: full-rank, Pufferfish and the pruning baselines at matched size.

The question the Pufferfish paper answers against pruning is "at the same parameter count, which
model is more accurate, and which one is actually cheaper to train and to run?". This module runs,
on the same data, epochs and seed, one after the other:

- ``full``: the dense network;
- ``pufferfish``: the configured recipe; its final parameter count ``P`` is computed up front by
  factorizing a copy of the freshly built model (no training needed; with ``rank_ratio``/``keep``
  ``auto`` it is read from the finished run instead);
- ``lth``: the lottery ticket pruned to ``P`` nonzero parameters (20% rounds, the last one partial);
- ``prune``: network slimming cut to at most ``P`` parameters;
- optionally ``pufferfish-matched``: Pufferfish with the rank ratio whose factorized network has
  the pruned network's parameter count (bisection on exact counts).

Each run is an ordinary run directory under ``OUT`` (``pufferfish report`` reads it) and is
resumed, not redone, when ``compare`` is run again (``--overwrite``: redone). Then every final model is rebuilt from its last
checkpoint and timed on this machine's CPU (eval mode, batch 1 and 128, median of repeats), and
``OUT/compare.md`` (a table), ``OUT/compare.json`` and ``OUT/tradeoff.png`` are written, next to
``report.md``/``accuracy.png`` (the per-epoch curves of :func:`~pufferfish.report.compare_runs`).

Honesty about LTH: its ``params`` are the *nonzero* ones, but its MACs and latency are measured on
the dense network with zeros in it, because that is what dense kernels compute; the table says so.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from .. import data as datasets
from .. import models
from ..config import ConfigError, TrainConfig
from ..configfile import dump_toml
from ..formatting import markdown_table
from ..lowrank import factorize
from ..lowrank.counting import count_params
from ..outputs import claim_outputs, hold, seal_outputs
from ..report import REPORT_FILES, compare_runs
from ..training import checkpoint as ckpt
from ..training.loop import train
from ..training.methods import build_method
from ..training.metrics import read_metrics

__all__ = ["COMPARED_MODES", "compare", "measure_latency", "pufferfish_params", "ratio_for_params"]

COMPARED_MODES = ("full", "pufferfish", "lth", "prune")


def build_model(cfg: TrainConfig) -> tuple[nn.Module, torch.Tensor]:
    """The freshly built (untrained) model of ``cfg`` and a one-example input, as the loop builds them."""

    if cfg.is_lm:
        raise ConfigError(f"compare supports the image models resnet18 and vgg19_bn, not {cfg.model!r}")
    ds = datasets.load_dataset(cfg.data, cfg.data_dir or None)
    assert isinstance(ds, datasets.ImageDataset)
    torch.manual_seed(cfg.seed)
    model = models.build_at_width(cfg.model, cfg.width, num_classes=ds.num_classes,
                                  in_channels=ds.in_channels, image_size=ds.image_size[0])
    return model, torch.zeros(1, ds.in_channels, *ds.image_size)


def _factorize_kwargs(cfg: TrainConfig, example: torch.Tensor) -> dict[str, Any]:
    return dict(keep=list(cfg.keep), preset=None if cfg.preset == "none" else cfg.preset,
                keep_first=cfg.keep_first, extra_bn=cfg.extra_bn,
                example_input=example if cfg.keep_first else None)


def pufferfish_params(cfg: TrainConfig, model: nn.Module, example: torch.Tensor,
                      ratio: float | None = None) -> int | None:
    """Parameters of ``model`` after Pufferfish's factorization under ``cfg`` (None if ``auto``).

    Factorizes a copy: the count depends on the shapes and ranks only, not on trained values.
    """

    if ratio is None and (cfg.ratio == "auto" or cfg.keep_auto):
        return None
    report = factorize(copy.deepcopy(model), rank_ratio=float(ratio or cfg.ratio),
                       **_factorize_kwargs(cfg, example))
    return report.params_after


def ratio_for_params(cfg: TrainConfig, model: nn.Module, example: torch.Tensor,
                     target: int) -> float:
    """The rank ratio whose factorized model has the parameter count closest to ``target``."""
    lo, hi = 1e-3, 1.0
    best = (abs(pufferfish_params(cfg, model, example, hi) - target), hi)  # type: ignore[operator]
    for _ in range(20):
        mid = (lo + hi) / 2
        n = pufferfish_params(cfg, model, example, mid)
        assert n is not None
        best = min(best, (abs(n - target), mid))
        if n > target:
            hi = mid
        else:
            lo = mid
    return round(best[1], 4)


def measure_latency(model: nn.Module, example: torch.Tensor, batch: int, repeats: int) -> float:
    """Median seconds of one eval-mode forward pass of ``batch`` examples (after one warm-up)."""
    model.eval()
    x = torch.randn(batch, *example.shape[1:])
    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(repeats):
            t = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def load_final_model(cfg: TrainConfig, run_dir: Path) -> tuple[nn.Module, torch.Tensor]:
    """The run's final network, rebuilt the way resume rebuilds it (the method's state, then the
    weights).

    Lottery-ticket masks are folded into plain dense weights (``prune.remove``): what a dense
    deployment would run.
    """
    model, example = build_model(cfg)
    found = ckpt.latest_checkpoint(run_dir)
    if found is None:
        raise FileNotFoundError(f"run directory {str(run_dir)!r} has no checkpoint")
    saved, _ = found
    method = build_method(cfg)
    method.setup(model, example, cfg)
    method.load_state_dict(saved["method"], model)
    model.load_state_dict(saved["model"])

    for module in model.modules():
        if hasattr(module, "weight_mask"):
            prune.remove(module, "weight")
    return model, example


def _run(cfg: TrainConfig, workers: int, log: Path) -> None:
    """Train (or continue) one run: in this process, or under torchrun with ``workers`` processes."""
    if workers <= 1:
        train(cfg)
        return
    config = log.with_suffix(".toml")
    config.write_text(dump_toml(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(workers), "-m", "pufferfish", "train", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with log.open("w") as f:
        result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{cfg.mode} run under torchrun failed ({result.returncode}): {tail[0]} "
                           f"(log: {log})")


def compare(base: TrainConfig, out: str | Path, methods: tuple[str, ...] = COMPARED_MODES,
            matched: bool = False, workers: int = 1, repeats: int = 20,
            latency: bool = True) -> str:
    """Run the methods on ``base``'s data and schedule under ``out``; return the Markdown table."""
    unknown = [m for m in methods if m not in COMPARED_MODES]
    if unknown or not methods:
        raise ConfigError(f"methods {','.join(methods)!r} is invalid: allowed a subset of "
                          f"{','.join(COMPARED_MODES)}")
    with hold(out, "compare"):  # from the claim until sealed: no other command writes there
        return _compare(base, Path(out), methods, matched, workers, repeats, latency)


def _compare(base: TrainConfig, out_dir: Path, methods: tuple[str, ...], matched: bool,
             workers: int, repeats: int, latency: bool) -> str:
    """:func:`compare` in ``out_dir``, held."""
    # Its own files (the runs' directories follow `train`'s rule); report.md is compare's here.
    logs = [f"{m}.log" for m in (*methods, *(["pufferfish-matched"] if matched else []))]
    claim_outputs(out_dir, "compare", ["compare.md", "compare.json", "tradeoff.png",
                                       *REPORT_FILES, *logs], base.overwrite)
    model, example = build_model(base)
    target = pufferfish_params(base, model, example)
    dense = count_params(model)
    runs: list[tuple[str, TrainConfig]] = []

    def config(name: str, **changes: Any) -> TrainConfig:
        # Continue the run of an earlier compare where it has checkpoints; else (or with
        # --overwrite) start it, replacing what an attempt that died before its first
        # checkpoint left there (the run's own files only).
        run_dir = out_dir / name
        again = not base.overwrite and bool(ckpt.checkpoint_files(run_dir))
        cfg = dataclasses.replace(base, out=str(run_dir), resume=str(run_dir) if again else "",
                                  overwrite=not again, **changes)
        runs.append((name, cfg))
        return cfg

    def train_one(name: str, cfg: TrainConfig) -> list[dict[str, Any]]:
        print(f"== compare: {name} ({cfg.mode}) -> {cfg.out}", flush=True)
        _run(cfg, workers, out_dir / f"{name}.log")
        rows = read_metrics(cfg.out)
        if not rows:
            raise RuntimeError(f"run {name} wrote no metrics")
        return rows

    for name in methods:
        if name in ("lth", "prune") and target is None:
            raise ConfigError("lth/prune need Pufferfish's parameter count: with rank_ratio or "
                              "keep 'auto' run the pufferfish method first (methods order)")
        if name == "full":
            train_one(name, config(name, mode="full"))
        elif name == "pufferfish":
            rows = train_one(name, config(name, mode="pufferfish"))
            if target is None:
                target = int(rows[-1]["params"])
            elif rows[-1]["params"] != target:
                print(f"compare: note: pufferfish ended with {rows[-1]['params']:,} parameters, "
                      f"{target:,} predicted; matching the others to the run", flush=True)
                target = int(rows[-1]["params"])
        elif name == "lth":
            train_one(name, config(name, mode="lth", target_params=target))
        else:
            train_one(name, config(name, mode="prune", target_params=target))
    if matched:
        pruned = [cfg for name, cfg in runs if name == "prune"]
        if not pruned:
            raise ConfigError("--also-matched-pufferfish needs the prune method")
        goal = int(read_metrics(pruned[0].out)[-1]["params"])
        ratio = ratio_for_params(base, model, example, goal)
        train_one("pufferfish-matched", config("pufferfish-matched", mode="pufferfish",
                                               rank_ratio=str(ratio)))

    results = [_summarize(name, cfg, dense, latency, repeats) for name, cfg in runs]
    table = _table(base, results, target, latency)
    (out_dir / "compare.md").write_text(table + "\n\n![trade-off](tradeoff.png)\n")
    (out_dir / "compare.json").write_text(json.dumps(results, indent=1, default=float))
    _plot(results, out_dir / "tradeoff.png", latency)

    compare_runs([cfg.out for _, cfg in runs], str(out_dir), command="compare", held=True)
    seal_outputs(out_dir, "compare", ["compare.md", "compare.json", "tradeoff.png", *logs])
    return table + f"\n\nwritten: {out_dir / 'compare.md'}, {out_dir / 'tradeoff.png'}, " \
                   f"{out_dir / 'report.md'}"


def _summarize(name: str, cfg: TrainConfig, dense: int, latency: bool,
               repeats: int) -> dict[str, Any]:
    rows = read_metrics(cfg.out)
    last = rows[-1]
    result: dict[str, Any] = {
        "method": name, "mode": cfg.mode, "run": cfg.out, "params": int(last["params"]),
        "params_vs_full": last["params"] / dense, "macs": int(last["macs"]),
        "test_acc": last["test_acc"], "val_acc": last.get("val_acc"), "epochs_trained": len(rows),
        "train_seconds": sum(r["epoch_time"] for r in rows), "rank_ratio": cfg.rank_ratio,
        "density": last.get("density"), "rounds": last.get("round"),
        "switch_epoch": last.get("switch_epoch"), "prune_epoch": last.get("prune_epoch"),
    }
    if latency:
        model, example = load_final_model(cfg, Path(cfg.out))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        result["threads"] = torch.get_num_threads()
        result["latency_b1_ms"] = 1e3 * measure_latency(model, example, 1, repeats)
        result["latency_b128_ms"] = 1e3 * measure_latency(model, example, 128,
                                                          max(3, repeats // 4))
    return result


def _note(r: dict[str, Any]) -> str:
    if r["mode"] == "pufferfish":
        return f"rank ratio {r['rank_ratio']}, low-rank from epoch {(r['switch_epoch'] or 0) + 1}" + (
            " (ratio matched to the pruned model)" if r["method"] == "pufferfish-matched" else "")
    if r["mode"] == "lth":
        return (f"{r['rounds']} pruning rounds, density {r['density']:.3f}; params = nonzero; "
                "MACs and latency are the dense network's (masked weights are still multiplied: "
                "no sparse kernels)")
    if r["mode"] == "prune":
        return f"channels cut at epoch {r['prune_epoch']}, then fine-tuned; physically smaller"
    return "dense baseline"


def _table(base: TrainConfig, results: list[dict[str, Any]], target: int | None,
           latency: bool) -> str:
    head = ["method", "params", "vs full", "MACs", "test acc", "epochs trained", "train s"]
    if latency:
        head += ["latency b=1 (ms)", "latency b=128 (ms)"]
    head.append("notes")
    lines = [
        f"# {base.model} (width {base.width}) on {base.data}: Pufferfish vs pruning at matched size",
        "",
        f"{base.epochs} epochs per run (LTH: per round), batch {base.batch_size}, lr {base.lr}, "
        f"seed {base.seed}, train subset {base.train_subset or 'all'}, {base.val_subset} "
        f"training images held out for validation, test subset {base.test_subset or 'all'}; "
        f"matched parameter target {target:,}" if target else "",
        "",
    ]
    rows = []
    for r in results:
        macs = f"{r['macs'] / 1e6:.1f}M" + (" (dense)" if r["mode"] == "lth" else "")
        cells = [r["method"], f"{r['params']:,}", f"{r['params_vs_full']:.3f}", macs,
                 f"{100 * r['test_acc']:.2f}%", str(r["epochs_trained"]),
                 f"{r['train_seconds']:.0f}"]
        if latency:
            dense_note = " (dense)" if r["mode"] == "lth" else ""
            cells += [f"{r['latency_b1_ms']:.2f}{dense_note}",
                      f"{r['latency_b128_ms']:.1f}{dense_note}"]
        cells.append(_note(r))
        rows.append(cells)
    lines += markdown_table(head, rows)
    if latency and results:
        lines += ["", f"Latency: this machine's CPU, {results[0]['threads']} thread(s), eval mode, "
                      "median of repeats after a warm-up; a shared machine makes it noisy."]
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path, latency: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("params", "parameters (LTH: nonzero)", True),
              ("train_seconds", "training seconds (all epochs)", False)]
    if latency:
        panels.insert(1, ("latency_b1_ms", "latency, batch 1 (ms)", False))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, label, log) in zip(axes, panels):
        for r in results:
            ax.scatter(r[key], 100 * r["test_acc"])
            ax.annotate(r["method"], (r[key], 100 * r["test_acc"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel=label, ylabel="test accuracy (%)", xscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
