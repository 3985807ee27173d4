"""One cached, resumable queue of ``pufferfish train`` runs: what every study driver runs through.

A study is a list of :class:`Run` (a directory and its flags). :func:`run_all` trains each one
that has not finished (its last metrics row is its last epoch's and has a test metric: an image
run records its test accuracy every epoch), resuming a stopped run from its
newest checkpoint, starting again one stopped before its first; each run's command and output go
to ``RUN.log`` beside it. Drivers decide *what* to run (grids, choices on validation); this
module owns *how*, so a stopped study resumes the same way whichever driver queued it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pufferfish.training.checkpoint import latest_checkpoint
from pufferfish.training.checkpoint.atomic import atomic_write
from pufferfish.training.rundir import run_files

__all__ = ["Run", "cache", "copy_once", "finished", "parser", "run_all", "train"]


@dataclass(frozen=True)
class Run:
    """One ``pufferfish train`` run: its directory, its flags (no ``--out``/``--resume``), and
    its number of processes (2: under torchrun, one thread each; 1: one process, every core)."""

    path: Path
    flags: tuple[str, ...] = field(default_factory=tuple)
    nproc: int = 2


def finished(path: Path) -> dict | None:
    """The last metrics row of a finished run, else None: the row of the run's last epoch (its
    ``config.toml``'s ``epochs``) with ``test_ppl`` or ``test_acc``. An image run records its
    test accuracy every epoch, so a test metric alone does not say that it finished."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows or not ("test_ppl" in rows[-1] or "test_acc" in rows[-1]):
        return None
    config = path / "config.toml"
    epochs = tomllib.loads(config.read_text()).get("epochs", 0) if config.is_file() else 0
    return rows[-1] if rows[-1].get("epoch", epochs) >= epochs else None


def command(run: Run) -> list[str]:
    """The run's command line, resuming from its newest checkpoint if it has one (2 processes or
    more: under torchrun)."""
    resume = (["--resume", "auto"] if latest_checkpoint(run.path) is not None else
              ["--overwrite"] if run.path.is_dir() else [])
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(run.nproc)] if run.nproc > 1 else [sys.executable])
    return [*launcher, "-m", "pufferfish", "train", *run.flags, "--out", str(run.path), *resume]


def train(run: Run) -> bool:
    """Train ``run`` (resumed where it stopped); True when it finished. One line says how."""
    run.path.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(run)
    threads = {"OMP_NUM_THREADS": "1"} if run.nproc > 1 else {}  # one process: every core
    with open(f"{run.path}.log", "a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **threads})
    last = finished(run.path)
    print(f"done: {run.path}{_quality(last)}" if last else
          f"FAILED: {run.path} (exit {code}, see {run.path}.log)", flush=True)
    return last is not None


def _quality(last: dict) -> str:
    """A finished run's validation and test figures (nan where it had no validation split)."""
    kind, digits = ("ppl", 2) if "test_ppl" in last else ("acc", 4)
    return f" val {last.get(f'val_{kind}', float('nan')):.{digits}f} " \
           f"test {last[f'test_{kind}']:.{digits}f}"


def run_all(runs: Iterable[Run], dry_run: bool = False) -> list[Run]:
    """Train every run of ``runs`` not finished yet, in order (``dry_run``: list them, each with
    its command line); returns the runs that were pending."""
    pending = [r for r in runs if finished(r.path) is None]
    for run in pending:
        if dry_run:
            print(f"would run: {run.path}: {' '.join(command(run))}")
        else:
            train(run)
    return pending


def _refuse_different(src: Path, target: Path) -> None:
    if target.is_file() and target.read_bytes() != src.read_bytes():
        raise SystemExit(f"sweep: {target} is cached already and differs from {src}: allowed "
                         "a cache folder of its own, or the same result")


def copy_once(src: Path, target: Path) -> None:
    """Copy ``src`` to ``target`` for the cache, atomically (a kill leaves no half file): one
    there already is kept when the same, and refused when different (a cached result is never
    overwritten)."""
    _refuse_different(src, target)
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes()
        atomic_write(target, lambda f: f.write(data))


def cache(paths: Iterable[Path], dest: Path) -> list[Path]:
    """Copy each finished run of ``paths`` into ``dest`` under its own name, its record only
    (config, metrics, change records: what ``pufferfish train`` wrote at its top level, not its
    checkpoints), each file by :func:`copy_once` once all of the run's were checked; returns
    the copies."""
    copies = []
    for path in (p for p in paths if finished(p) is not None and not _cached(p, dest)):
        files = [f for f in run_files(path) if f.parent == path]
        if not files:  # no record of its own: a copy of the cache's, edited since?
            for f in (f for f in path.iterdir() if f.is_file()):
                _refuse_different(f, dest / path.name / f.name)
        if not {"config.toml", "metrics.jsonl"} <= {f.name for f in files}:
            raise SystemExit(f"sweep: {path} holds no config.toml and metrics.jsonl of a "
                             "`pufferfish train` run: allowed only runs the queue trained")
        for f in files:
            _refuse_different(f, dest / path.name / f.name)
        for f in files:
            copy_once(f, dest / path.name / f.name)
        copies.append(dest / path.name)
    return copies


def _cached(path: Path, dest: Path) -> bool:
    """Whether the run ``path`` is a copy of its cached record in ``dest`` (every file there,
    byte for byte): a study's OUT started again from its cache on a fresh machine."""
    files = [f for f in path.iterdir() if f.is_file()]
    return bool(files) and all((dest / path.name / f.name).is_file()
                               and (dest / path.name / f.name).read_bytes() == f.read_bytes()
                               for f in files)


def parser(doc: str) -> tuple[argparse.ArgumentParser, Any]:
    """A study driver's command line: ``run OUT [--dry-run]``, the parser and its subparsers (a
    driver adds its other commands there); the description is ``doc``'s first line."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--dry-run", action="store_true")
    return ap, sub
