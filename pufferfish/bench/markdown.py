"""The bench's Markdown: ``results.md`` (links, measuring order, measured rows, the compute sanity
check, the projection, time to accuracy, failures, plots) and ``--train``'s ``train.md``; every
table through :func:`pufferfish.formatting.markdown_table`."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from ..formatting import markdown_table
from . import accuracy as acc
from . import projection as proj
from .bandwidth import format_bps
from .config import BenchConfig, results_path
from .methods import MethodSpec, base_of
from .rounds import spread
from .usermodel import is_user_model
from .verdict import verdict_markdown
from .workload import is_lm, rank_ratio_of

__all__ = ["results_markdown", "train_markdown"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _ms_spread(row: dict[str, Any], key: str) -> str:
    """``median [min–max]`` in milliseconds."""
    low, high = row["spread"][key]
    return f"{_ms(row[key])} [{_ms(low)}–{_ms(high)}]"


def _data(cfg: BenchConfig) -> str:
    if is_user_model(cfg.model):
        return "the workload's make_batch"
    if not is_lm(cfg.model):
        return "Fashion-MNIST"
    return f"KJV sequences of {cfg.seq_len} words (vocabulary {cfg.vocab_size})"


def _accumulation(cfg: BenchConfig) -> str:
    """``--grad-accum``: what a step is then."""
    if cfg.grad_accum == 1:
        return ""
    return (f", {cfg.grad_accum} micro-batches per step (one gradient synchronization; times "
            "and bytes per optimizer step)")


def results_markdown(cfg: BenchConfig, result: dict[str, Any], plots: list[Path]) -> str:
    """``results.md``: how it was measured, then every section ``result`` has."""
    rows = result["rows"]
    source = (f"Step times reused from `{results_path(cfg.from_results)}`. "
              if cfg.from_results else "")
    lines = [
        f"# pufferfish bench: {cfg.model}"
        f"{'' if is_user_model(cfg.model) else f' x{cfg.width}'}, {cfg.workers} workers"
        f"{' (torchrun)' if cfg.torchrun else ''}",
        "",
        *_verdict_lines(result),
        f"{source}Per worker: batch {cfg.batch_size} of {_data(cfg)}{_accumulation(cfg)}"
        f"{', compiled (torch.compile)' if cfg.compile else ''}{_amp(cfg)}, "
        f"{cfg.worker_threads()} torch thread(s); per method and round {cfg.warmup} warm-up "
        f"steps, {cfg.compute_steps} compute-only steps, {cfg.steps} timed steps; {cfg.rounds} "
        f"interleaved round(s). torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{platform.platform()}. PowerSGD rank {cfg.powersgd_rank} (compressing from step "
        f"{cfg.powersgd_start_iter}), top-k ratio {cfg.topk_ratio}, signum beta "
        f"{cfg.signum_beta}; pufferfish = "
        + ("the workload's keep / preset / rank_ratio (the factorization report is in the log)"
           + ("" if cfg.rank_ratio is None else f" at rank ratio {cfg.rank_ratio:g}")
           if is_user_model(cfg.model)
           else f"the paper preset at rank ratio {rank_ratio_of(cfg):g}")
        + _variants(cfg),
        "",
        "Each round runs one worker group per link that measures every method in turn; the "
        "order of links and of methods rotates from round to round (below). Per round: step = "
        "median full DDP step with the method's hook; compute = median step under "
        "`ddp.no_sync()` (no gradient communication); comm = step - compute, the communication "
        "(and hook encode/decode) NOT hidden by overlap; share = comm / step; compress = the "
        "hook's encode/decode time (a lower bound for PowerSGD, whose decode runs in callbacks); "
        "times are the slowest rank's. Cells: median over rounds [min–max over rounds]. "
        "speedup vs ddp = DDP's step / the method's step in the same round and link, then "
        "median [min–max]. MB = payload per step (`bytes_sent`), ring MB = what a rank sends "
        "under the ring model. predicted = the α-β model at this worker count and the probed "
        "link rate, from this row's compute and compress; error = (predicted - step) / step. "
        f"buckets = DDP's bucket cap in MiB per round (--bucket-mb {cfg.bucket_mb}; torch: "
        "torch's default, 1 MiB then 25 MiB); overlap = max(compute, wire time at the probed "
        "link rate under the ring model) / step, 1.0 when communication hides entirely; vs "
        "torch's buckets = the same group's steps with torch's default buckets right after "
        "the timed ones / the timed step (1.00x where the method's cap is torch's).",
        *_devices_lines(result),
        "",
        "## Links",
        "",
        "A link's delay is netem's, each way (`100mbit@20ms`); the probed round trip is the "
        "median all-reduce of one float (2 workers: one round trip), whose half is the α the "
        "predicted column uses (not probed: --alpha-us + the delay).",
        "",
        *markdown_table(["bandwidth", "nominal", "one-way delay",
                         "probed all-reduce bus bandwidth", "probed round trip"],
                        _link_rows(result)),
    ]
    lines += ["", "Measuring order:", ""]
    lines += [f"{r + 1}. " + "; ".join(f"{text} ({', '.join(ms)})" for text, ms in plan)
              for r, plan in enumerate(result["order"])]
    head = ["method", "bandwidth", "rounds", "step ms", "compute ms", "comm ms", "share",
            "compress ms", "MB/step", "ring MB/step", "params", "speedup vs ddp",
            "predicted ms", "error", "buckets MiB", "vs torch's buckets", "overlap"]
    lines += ["", "## Measured", "", *markdown_table(head, map(_measured_cells, rows))]
    lines += _sharded_markdown(rows, result["rounds"])
    lines += _compute_check_markdown(result["compute_check"], [x["bandwidth"]
                                                               for x in result["links"]])
    lines += _projection_markdown(result["projection"])
    if result["time_to_accuracy"]:
        lines += acc.markdown(result["time_to_accuracy"])
    if result["failures"]:
        lines += ["", "## Failed groups", ""]
        lines += [f"- {f['method']} @ {f['bandwidth']}"
                  + (f", round {f['round'] + 1}" if "round" in f else "") + f": {f['error']}"
                  for f in result["failures"]]
    if plots:
        lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    return "\n".join(lines) + "\n"


def _devices_lines(result: dict[str, Any]) -> list[str]:
    """Where the steps ran (records from before devices were named say nothing), and, on a GPU,
    what the host's clock cannot see: the compressors' GPU encode/decode."""
    seen = sorted({(str(r.get("device", "cpu")).split(":")[0], r.get("device_name") or "")
                   for r in result.get("rounds", []) if "device_name" in r})
    if not seen:
        return []
    lines = ["", "Measured on: " + ", ".join(f"{kind} ({name})" if name else kind
                                            for kind, name in seen) + "."]
    if any(kind == "cuda" for kind, _ in seen):
        lines.append("On a GPU, compress is the host's time around the hooks' encode/decode (the "
                     "kernels' launches, not their GPU work): a lower bound, so the predicted "
                     "column and the projections leave the compressors' GPU work out and flatter "
                     "PowerSGD, top-k and signum; the measured steps include it.")
    return lines


def _variants(cfg: BenchConfig) -> str:
    """The sentence on methods measured with their own settings (``powersgd:rank=1``), if any."""
    own = [m for m in cfg.methods if ":" in m]
    if not own:
        return "."
    return (f". Measured with their own settings (over the values above): {', '.join(own)}; "
            "each row is named by its method and settings.")


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    """The opening table and sentences (:mod:`pufferfish.bench.verdict`), then how to read them;
    nothing for results from before the verdict."""
    v = result["projection"].get("verdict")
    lines = verdict_markdown(v) if v else []
    if not lines:
        return []
    return [*lines, "",
            "Medians over rounds on each link: step = a full step with the method's comm hook; "
            "compute = the same step without communication; exposed comm = step - compute (the "
            "communication, with encode/decode, that overlap did not hide); encode/decode = the "
            "hook's own timer; MB = payload per step. The sentence: the α-β model with each "
            "method's time on the wire rescaled (bench/verdict.py). Details below.", ""]


def _amp(cfg: BenchConfig) -> str:
    """``--amp``: the autocast of the timed steps (``bf16``, ``fp16`` with a GradScaler)."""
    amp = getattr(cfg, "amp", "none")
    return "" if amp == "none" else f", {amp} autocast" + (
        " with a GradScaler" if amp == "fp16" else "")


def _compute_source(projection: dict[str, Any]) -> str:
    """Where the projection's compute per method came from, the CPU-ratio fallback named."""
    sources = projection.get("compute_sources")
    if not sources:
        return ""
    per = ", ".join(f"{m} {ms:.1f}" for m, ms in projection["compute_ms"].items())
    if set(sources.values()) == {proj.MEASURED}:
        flag = ",".join(f"{m}={ms:.4g}" for m, ms in projection["compute_ms"].items())
        return (f" Compute per step (compute + encode/decode, ms), as measured here: {per}; "
                f"`--compute-ms {flag}` projects with them elsewhere, and `--compute-ms` sets "
                "another machine's.")
    given = ",".join(f"{k}={v:g}" for k, v in projection["compute_figures"].items())
    fallback = [m for m, src in sources.items() if src == proj.CPU_RATIO]
    note = (f" FALLS BACK to this machine's low-rank/full ratio "
            f"({projection['cpu_lowrank_compute_ratio']:.2f}) for {', '.join(fallback)}: no "
            "factorized= figure was given." if fallback else "")
    return (f" Compute per step (compute + encode/decode, ms) from `--compute-ms {given}`: "
            f"{per}.{note}")


def _link_rows(result: dict[str, Any]) -> list[list[str]]:
    """Each link's nominal and probed rate, then the links skipped (with why)."""
    rows = [[link["bandwidth"],
             format_bps(link["bandwidth_bps"]) if link["bandwidth_bps"] else "-",
             f"{link['delay_ms']:g} ms" if link.get("delay_ms") else "-",
             format_bps(link["link_bps"]) if link["link_bps"] else "-",
             _ms(link.get("link_rtt_s")) + " ms" if link.get("link_rtt_s") else "-"]
            for link in result["links"]]
    return rows + [[s["bandwidth"], f"skipped: {s['reason']}", "-", "-", "-"]
                   for s in result["skipped"]]


def _measured_cells(r: dict[str, Any]) -> list[str]:
    speed = "-" if r["speedup_vs_ddp"] is None else (
        f"{r['speedup_vs_ddp']:.2f}x [{r['spread']['speedup_vs_ddp'][0]:.2f}–"
        f"{r['spread']['speedup_vs_ddp'][1]:.2f}]")
    share = r["spread"]["comm_share"]
    err = "-" if r["prediction_error"] is None else f"{100 * r['prediction_error']:+.0f}%"
    return [r["method"], r["bandwidth"], str(r["rounds"]), _ms_spread(r, "step_time"),
            _ms_spread(r, "compute_time"), _ms_spread(r, "comm_time"),
            f"{100 * r['comm_share']:.0f}% [{100 * share[0]:.0f}–{100 * share[1]:.0f}]",
            _ms(r["compress_time"]), f"{r['bytes_per_step'] / 1e6:.3f}",
            f"{r['ring_bytes_per_step'] / 1e6:.3f}", f"{r['params'] / 1e6:.3f}M", speed,
            _ms(r["predicted_step_time"]), err,
            "-" if r.get("parallel") == "fsdp" else _buckets(r.get("buckets")),
            "-" if "bucket_speedup" not in r or r.get("parallel") == "fsdp"
            else f"{r['bucket_speedup']:.2f}x "
            f"[{r['spread']['bucket_speedup'][0]:.2f}–{r['spread']['bucket_speedup'][1]:.2f}]",
            "-" if r.get("overlap_efficiency") is None else f"{r['overlap_efficiency']:.2f}"]


def _sharded_markdown(rows: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> list[str]:
    """The FSDP2 rows (``fsdp``, ``pufferfish+fsdp``): what their collectives move, each process's
    share of the state, and the ratios to DDP and to full rank taken within each round."""
    sharded = [r for r in rows if r.get("parallel") == "fsdp"]
    if not sharded:
        return []
    head = ["method", "bandwidth", "all-gather MB", "reduce-scatter MB", "collectives",
            "ring MB", "ring vs DDP's", "shard params MB", "shard grads MB", "shard optimizer MB",
            "speedup vs ddp", "pufferfish+fsdp vs fsdp"]
    lines = [
        "", "## Sharded data parallel (FSDP2)", "",
        "fsdp / pufferfish+fsdp: the model sharded with FSDP2 (`pufferfish train --parallel "
        "fsdp`'s units: each block and the root), no channels_last; step = median full FSDP2 "
        "step; compute = median of the same steps on an unsharded local copy (FSDP2 has no "
        "communication-free mode). MB per step of each collective (payload, from the shards' "
        "sizes), the ring bytes a process sends against DDP's of the same model (ddp for fsdp, "
        "pufferfish for pufferfish+fsdp), and one process's sharded parameters, gradients and "
        "optimizer state. speedup vs ddp = DDP's step / this step; pufferfish+fsdp vs fsdp = "
        "fsdp's step / pufferfish+fsdp's: both within each round, median [min–max].", "",
    ]
    table = []
    for r in sharded:
        same = MethodSpec.parse(r["method"]).with_base("pufferfish" if r["factorized"] else "ddp")
        dense = next((x for x in rows if x["bandwidth"] == r["bandwidth"]
                      and x["method"] == same.name), None)
        vs_ddp = ("-" if dense is None
                  else f"{r['ring_bytes_per_step'] / dense['ring_bytes_per_step']:.2f}x")
        speed = "-" if r["speedup_vs_ddp"] is None else (
            f"{r['speedup_vs_ddp']:.2f}x [{r['spread']['speedup_vs_ddp'][0]:.2f}–"
            f"{r['spread']['speedup_vs_ddp'][1]:.2f}]")
        gain = _round_ratio(rounds, r["bandwidth"], "fsdp", r["method"]) \
            if base_of(r["method"]) == "pufferfish+fsdp" else "-"
        table.append([r["method"], r["bandwidth"], *(f"{r[k] / 1e6:.3f}" for k in (
            "all_gather_bytes_per_step", "reduce_scatter_bytes_per_step")),
            f"{r['collectives_per_step']:.0f}", f"{r['ring_bytes_per_step'] / 1e6:.3f}", vs_ddp,
            *(f"{r[k] / 1e6:.3f}" for k in ("shard_param_bytes", "shard_grad_bytes",
                                            "shard_optimizer_bytes")), speed, gain])
    return lines + markdown_table(head, table)


def _round_ratio(rounds: list[dict[str, Any]], link: str, base: str, method: str) -> str:
    """``base``'s step / ``method``'s in each round on ``link``: median [min–max]."""
    steps = {(r["round"], r["method"]): r["step_time"] for r in rounds if r["bandwidth"] == link}
    ratios = [steps[(k, base)] / steps[(k, method)] for k, m in steps
              if m == method and (k, base) in steps]
    if not ratios:
        return "-"
    s = spread(ratios)
    return f"{s['median']:.2f}x [{s['min']:.2f}–{s['max']:.2f}]"


def _buckets(caps: list[float | None] | None) -> str:
    """Each round's bucket cap, once when all rounds chose the same."""
    names = list(dict.fromkeys("torch" if c is None else f"{c:.3g}" for c in caps or [None]))
    return " / ".join(names)


def _compute_check_markdown(check: list[dict[str, Any]], links: list[str]) -> list[str]:
    """Compute-only medians per method on every link: they should agree (no link involved)."""
    if not check or len(links) < 2:
        return []
    head = ["method", *[f"{text} compute ms" for text in links], "max/min - 1", ""]
    lines = [
        "", "## Sanity check: compute does not depend on the link", "",
        "A compute-only step sends nothing, so its median should be the same on every link; a "
        "gap above 15% is flagged: the machine's load moved it, and rows that differ by less "
        "than such a gap do not differ.", "",
    ]
    rows = [[c["method"], *[_ms(c["compute_time"].get(text)) for text in links],
             f"{100 * c['disagreement']:.0f}%", "**> 15%: noisy**" if c["flagged"] else "ok"]
            for c in check]
    return lines + markdown_table(head, rows)


def _projection_markdown(projection: dict[str, Any]) -> list[str]:
    rows = projection["rows"]
    if not rows:
        return []
    bws = projection["bandwidths_bps"]
    alphas = projection.get("alphas") or [projection["alpha"]]
    shown = " and ".join(proj.format_alpha(a) for a in alphas)
    lines = [
        "",
        "## Projection (ring α-β model)",
        "",
        f"α = {shown} per message (--alpha-us, plus each link's one-way delay), paid once per "
        "collective: DDP one per bucket, PowerSGD three per bucket, DiLoCo one per outer step "
        "(1/inner-steps per step). Step = measured compute (median "
        "over all rows of the same model: full-rank or factorized, DDP's or FSDP2's) + the "
        "method's median compress + modelled communication with no overlap; all-reduce methods send 2(p-1)/p "
        "of their payload, all-gather ones (signum, topk) (p-1) times it, FSDP2 (p-1)/p of the "
        "unsharded bytes its all-gathers and reduce-scatters move. Cells: step ms "
        "(speedup vs ddp)." + _compute_source(projection),
    ]
    for a in alphas:
        for p in projection["workers"]:
            head = ["method", *[format_bps(b) for b in bws], "crossover vs ddp"]
            table = []
            for m in dict.fromkeys(r["method"] for r in rows):
                cells = []
                for b in bws:
                    r = next(x for x in rows if x["method"] == m and x["workers"] == p
                             and x["bandwidth_bps"] == b and x.get("alpha", a) == a)
                    speed = f" ({r['speedup_vs_ddp']:.2f}x)" if r["speedup_vs_ddp"] else ""
                    cells.append(f"{_ms(r['step_time'])}{speed}")
                cross = ("-" if r["crossover_region"] is None or m == "ddp" else proj.Crossover(
                    r["crossover_region"], r["crossover_bps"]).describe())
                table.append([m, *cells, cross])
            title = f"p = {p}" + (f", α = {proj.format_alpha(a)}" if len(alphas) > 1 else "")
            lines += ["", f"### {title}", "", *markdown_table(head, table)]
    return lines


def train_markdown(cfg: BenchConfig, runs: list[dict[str, Any]],
                   skipped: list[dict[str, str]], failures: list[dict[str, str]],
                   machine: dict[str, str] | None = None) -> str:
    """``train.md``: per link and method, accuracy and the time to the link's common target, and
    the machine it ran on (``machine``: its CPU and GPU by name)."""
    epochs = cfg.epochs_per_method()
    budget = ", ".join(f"{m} {e}" for m, e in epochs.items())
    lines = [
        f"# pufferfish bench --train: {cfg.model} x{cfg.width}, {cfg.workers} workers, "
        + (f"{cfg.epochs} epochs" if len(set(epochs.values())) <= 1 else f"epochs: {budget}"),
        "",
        "Time = summed training epoch times (evaluation excluded); target = the best test "
        "accuracy that every run on that link reached. Plots: train/<bandwidth>/accuracy.png.",
        "",
        *markdown_table(["bandwidth", "method", "epochs", "final acc", "best acc", "train s",
                         "target acc", "s to target"], map(_train_cells, runs)),
    ]
    lines += [f"- {s['bandwidth']}: skipped ({s['reason']})" for s in skipped]
    lines += [f"- {f['method']} @ {f['bandwidth']}: FAILED: {f['error']}" for f in failures]
    if machine:
        lines += ["", f"Measured on: {machine_words(machine)}."]
    return "\n".join(lines) + "\n"


def machine_words(machine: dict[str, str]) -> str:
    """A training record's machine (``machine_facts``) in words: 'CPU (AMD EPYC), GPU (H100)'."""
    return ", ".join(f"{kind.upper()} ({name})" for kind, name in machine.items())


def _train_cells(r: dict[str, Any]) -> list[str]:
    reach = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
    return [r["bandwidth"], r["method"], str(r["epochs"]), f"{100 * r['final_test_acc']:.2f}%",
            f"{100 * r['best_test_acc']:.2f}%", f"{r['train_time']:.1f}",
            f"{100 * r['target_acc']:.2f}%", reach]
