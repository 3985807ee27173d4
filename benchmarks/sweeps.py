"""The plain grids of ``pufferfish train`` runs, each a few lines over ``benchmarks/sweep.py``.

Each study is a function returning its list of :class:`sweep.Run`; the queue trains the ones not
finished (resuming a stopped one from its checkpoint). Flags after the study's own go to every
``pufferfish train`` of the grid (after ``--`` where they could be read as the study's).

    python benchmarks/sweeps.py grid CONFIG OUT [--warmups 1,2,4] [--ratios 0.125,0.25,0.5]
    python benchmarks/sweeps.py llama-lr OUT [--lrs ...] [--methods ...] [--seeds 0]
    python benchmarks/sweeps.py diloco OUT [--methods ...] [--h 10]
    python benchmarks/sweeps.py accuracy CONFIG OUT [--modes full,pufferfish,lowrank]

``grid``: hand-tuned Pufferfish settings (warm-up epochs x rank ratio, ``w{W}-r{R}``) beside the
automatic recipe (``auto``) and full rank (``full``), one process; ``llama-lr``: llama width 0.25
per method, LR and seed (``{method}-lr{lr}-s{seed}``), 2 processes; ``diloco``: DiLoCo against
DDP, PowerSGD and Pufferfish, one run per method (``diloco_tta.py`` times them over links);
``accuracy``: full rank, Pufferfish and low rank from the start. ``grid`` and ``accuracy`` end
with ``pufferfish report`` over their finished runs (``OUT/report.md``). Add ``--dry-run`` to list
the runs a study would train.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import sweep  # benchmarks/ is not a package: its folder on the path

LLAMA = ("--model", "llama", "--data", "kjv", "--width", "0.25", "--seq-len", "128",
         "--vocab-size", "4096", "--batch-size", "8", "--eval-every-steps", "100",
         "--bucket-mb", "torch")
LLAMA_METHODS: dict[str, tuple[str, ...]] = {
    "full": ("--mode", "full"), "pufferfish": ("--mode", "pufferfish", "--warmup-steps", "0.25"),
    "lowrank": ("--mode", "lowrank"), "galore": ("--mode", "galore")}
DILOCO = ("--sync", "diloco", "--inner-steps")  # + H
DILOCO_METHODS = ("ddp", "powersgd", "pufferfish", "diloco", "pufferfish+diloco",
                  "pufferfish+diloco-project")
MODES = ("full", "pufferfish", "lowrank")


def grid(config: str, out: Path, warmups: list[str], ratios: list[str],
         extra: tuple[str, ...] = ()) -> list[sweep.Run]:
    """Full rank, each warm-up x rank ratio, then the automatic recipe; one process each."""
    base = ("--config", config, "--no-progress", *extra)
    settings = [("full", ("--mode", "full"))]
    settings += [(f"w{w}-r{r}", ("--mode", "pufferfish", "--warmup-epochs", w, "--rank-ratio", r))
                 for w in warmups for r in ratios]
    settings += [("auto", ("--mode", "pufferfish", "--warmup-epochs", "auto", "--rank-ratio",
                           "auto", "--keep", "auto"))]
    return [sweep.Run(out / name, (*base, *flags), nproc=1) for name, flags in settings]


def llama_lr(out: Path, lrs: list[str], methods: list[str], seeds: list[str],
             extra: tuple[str, ...] = ()) -> list[sweep.Run]:
    """One 2-process llama run per seed, LR and method (in that nesting), equal tokens."""
    return [sweep.Run(out / f"{m}-lr{lr}-s{s}", (*LLAMA, *extra, *LLAMA_METHODS[m], "--lr", lr,
                                                "--seed", s, "--threads", "1", "--no-progress"))
            for s in seeds for lr in lrs for m in methods]


def diloco_flags(method: str, h: str) -> tuple[str, ...]:
    """``pufferfish train``'s flags of a method of the DiLoCo comparison at ``h`` inner steps."""
    mode = ("--mode", "pufferfish" if method.startswith("pufferfish") else "full")
    comm = ("--comm", "powersgd") if method == "powersgd" else ()
    sync = (*DILOCO, h) if "diloco" in method else ()
    project = ("--outer-switch-momentum", "project") if method.endswith("-project") else ()
    return (*mode, *comm, *sync, *project)


def diloco(out: Path, methods: list[str], h: str, extra: tuple[str, ...] = ()) -> list[sweep.Run]:
    """One 2-process run per method, named by the method."""
    return [sweep.Run(out / m, (*extra, *diloco_flags(m, h), "--threads", "1", "--no-progress"))
            for m in methods]


def accuracy(config: str, out: Path, modes: list[str],
             extra: tuple[str, ...] = ()) -> list[sweep.Run]:
    """One 2-process run per mode, named by the mode, same data, epochs and seed."""
    return [sweep.Run(out / m, ("--config", config, "--mode", m, "--no-progress", *extra))
            for m in modes]


def report(runs: list[sweep.Run], out: Path) -> int:
    """``pufferfish report`` over the finished runs of ``runs``, written to ``out``."""
    done = [str(r.path) for r in runs if sweep.finished(r.path) is not None]
    if len(done) < len(runs):
        print(f"report: {len(runs) - len(done)} of {len(runs)} runs not finished, left out")
    if not done:
        return 1
    return subprocess.call([sys.executable, "-m", "pufferfish", "report", *done, "--out", str(out)])


def _names(allowed: tuple[str, ...] | None = None) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list, each item one of ``allowed`` (if given)."""
    def parse(text: str) -> list[str]:
        items = [t for t in text.replace(" ", ",").split(",") if t]
        bad = [t for t in items if allowed is not None and t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{','.join(bad) or repr(text)}: expected a comma-separated list"
                + (f" of {', '.join(allowed)}" if allowed else ""))
        return items
    return parse


def _parser() -> argparse.ArgumentParser:
    """The studies' command line; abbreviations are off so that ``--seed`` passes through."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="study", required=True)
    studies = {name: sub.add_parser(name, allow_abbrev=False, help=help_) for name, help_ in (
        ("grid", "warm-up x rank ratio, the automatic recipe and full rank, one process"),
        ("llama-lr", "llama width 0.25 per method, LR and seed"),
        ("diloco", "DiLoCo against DDP, PowerSGD and Pufferfish"),
        ("accuracy", "full rank, Pufferfish and low rank from the start"))}
    for name in ("grid", "accuracy"):
        studies[name].add_argument("config", help="the --config of every run")
    for p in studies.values():
        p.add_argument("out", type=Path, help="the study's folder (one run directory a run)")
        p.add_argument("--dry-run", action="store_true", help="list the runs, train none")
    studies["grid"].add_argument("--warmups", type=_names(), default="1,2,4")
    studies["grid"].add_argument("--ratios", type=_names(), default="0.125,0.25,0.5")
    studies["llama-lr"].add_argument("--lrs", type=_names(), default="0.001,0.003,0.006,0.012")
    studies["llama-lr"].add_argument("--methods", type=_names(tuple(LLAMA_METHODS)),
                                     default=",".join(LLAMA_METHODS))
    studies["llama-lr"].add_argument("--seeds", type=_names(), default="0")
    studies["diloco"].add_argument("--methods", type=_names(DILOCO_METHODS),
                                   default=",".join(DILOCO_METHODS))
    studies["diloco"].add_argument("--h", default="10", help="DiLoCo's --inner-steps")
    studies["accuracy"].add_argument("--modes", type=_names(MODES), default=",".join(MODES))
    return ap


def runs_of(args: argparse.Namespace, extra: tuple[str, ...]) -> list[sweep.Run]:
    """The runs of the study ``args`` names, ``extra`` flags passed to each."""
    if args.study == "grid":
        return grid(args.config, args.out, args.warmups, args.ratios, extra)
    if args.study == "llama-lr":
        return llama_lr(args.out, args.lrs, args.methods, args.seeds, extra)
    if args.study == "diloco":
        return diloco(args.out, args.methods, args.h, extra)
    return accuracy(args.config, args.out, args.modes, extra)


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    extra = tuple(extra[1:] if extra[:1] == ["--"] else extra)
    runs = runs_of(args, extra)
    sweep.run_all(runs, dry_run=args.dry_run)
    if args.study in ("grid", "accuracy") and not args.dry_run:
        return report(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
