"""Fault campaign: kill, starve, freeze and corrupt a 2-process run; count what survives.

Runs a tiny configuration (ResNet-18 at width 1/8 on 256 Fashion-MNIST images, 2 processes under
torchrun, 3 epochs of 4 steps, a checkpoint every 2 steps, the top-k comm hook whose per-rank
memory must survive a resume) once without faults, then once per fault:

* ``kill``, N times: SIGKILL a worker before a random step (random rank), or rank 0 inside a
  checkpoint write (payload in its temp file, or payload in place without its manifest); torchrun
  ``--max-restarts 1`` restarts the group, which resumes by itself;
* ``disk-full``: the run directory on a small tmpfs, filled at a random step before a mid-epoch
  checkpoint; the write fails (ENOSPC), the disk is enlarged, ``--resume auto`` continues
  (needs root to mount; skipped otherwise);
* ``freeze``: SIGSTOP a worker at a random step; the other must fail with a one-line PeerError
  within ``--timeout-s``, torchrun restarts the group, which resumes;
* ``corrupt``: the run killed at a random step, its newest checkpoint replaced by other data;
  ``--resume`` must fall back to the previous one and set the bad one aside (bytes intact);
* ``corrupt-all``: every checkpoint of a killed run damaged; ``--resume`` must refuse (exit 2, one
  line naming each file) and change nothing.

Each fault is injected through ``pufferfish.training.faults`` as a SIGSTOP, so that the driver can
record every file of the run directory (name and SHA-256) at the moment of the fault before it
delivers the real fault. After recovery each recorded file must still exist with the same bytes, or
be accounted for: rotated by ``keep_checkpoints`` (a complete checkpoint older than the kept ones),
set aside in ``checkpoints/rejected/`` (found there by its bytes), a temp file of an interrupted
write (the program's own), or a record the program rewrites (metrics, config.toml, factorization);
anything else is a file lost. A recovered run's final checkpoint must equal the uninterrupted
run's bitwise: parameters, buffers, optimizer state, comm-hook memory, method state; and its
metrics too, except wall times.

    benchmarks/faults.sh [--kills N] [--seed S] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pufferfish.training import checkpoint as ckpt
from pufferfish.training.faults import wait_stopped

STEPS_PER_EPOCH, EPOCHS, EVERY = 4, 3, 2
TOTAL = STEPS_PER_EPOCH * EPOCHS
CHECKPOINT_STEPS = list(range(EVERY, TOTAL + 1, EVERY))
KEEP = 3  # --keep-checkpoints (the default)
TIMEOUT_S = 10  # --timeout-s: how long a frozen peer goes unnoticed
FLAGS = ["--model", "resnet18", "--width", "0.125", "--train-subset", "256", "--test-subset", "64",
         "--batch-size", "32", "--lr", "0.05", "--epochs", str(EPOCHS), "--warmup-epochs", "1",
         "--checkpoint-every-steps", str(EVERY), "--keep-checkpoints", str(KEEP), "--comm", "topk",
         "--topk-ratio", "0.1", "--threads", "1", "--no-progress", "--timeout-s", str(TIMEOUT_S)]
TIMES = {"epoch_time", "compute_time", "data_time", "comm_time", "compress_time"}
REWRITTEN = re.compile(r"^(config\.toml|metrics\.(jsonl|csv)|factorization\.(txt|json))$")


@dataclass
class Trial:
    kind: str
    where: str
    recovered: bool | None = None  # None: recovery is not expected (a refusal)
    equal: bool | None = None
    lost: list[str] = field(default_factory=list)
    note: str = ""


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, *extra: str, restarts: int = 0, fault: dict[str, str] | None = None,
             ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--master-port", str(free_port()),
           "-m", "pufferfish", "train", *FLAGS, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(fault or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    code, lines = finish_timed(proc, timeout)
    return code, "".join(line for _, line in lines)


def finish_timed(proc: subprocess.Popen, timeout: float = 600,
                 ) -> tuple[int, list[tuple[float, str]]]:
    """Exit status and the output lines, each with the time (monotonic) it arrived."""
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line) for line in proc.stdout), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        lines.append((time.monotonic(), "[faults.py: timed out]\n"))
    reader.join(timeout=30)
    return proc.returncode, lines


def fault_env(marker: Path, step: int, rank: int = 0, during: str = "step") -> dict[str, str]:
    """Arm a SIGSTOP at ``during`` of ``step``: the driver decides what happens next."""
    return {"PUFFERFISH_KILL_AT_STEP": str(step), "PUFFERFISH_KILL_RANK": str(rank),
            "PUFFERFISH_KILL_DURING": during, "PUFFERFISH_KILL_SIGNAL": "STOP",
            "PUFFERFISH_KILL_MARKER": str(marker)}


# -- files -------------------------------------------------------------------------------------


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def files_lost(before: dict[str, str], run: Path) -> list[str]:
    """Files recorded at the fault that are gone or changed, rotation and own temp files aside."""
    after = digests(run)
    set_aside = {d for name, d in after.items()
                 if name.startswith(f"{ckpt.CHECKPOINT_SUBDIR}/{ckpt.REJECTED_SUBDIR}/")}
    kept_steps = sorted(ckpt.checkpoint_step(p) for p in ckpt.checkpoint_files(run)
                        if p.suffix == ".pt")
    lost = []
    for name, digest in before.items():
        base = Path(name).name
        if after.get(name) == digest or digest in set_aside:
            continue
        if name in after and REWRITTEN.match(base):
            continue  # a record the run rewrites (metrics rows of redone epochs, config.toml)
        if base.endswith(".tmp"):
            continue  # a temp file of the interrupted write: the program's own, removed by it
        m = re.match(r"^ckpt-(\d+)\.(pt|json)$", base)
        if (m and name not in after and len(kept_steps) == KEEP
                and int(m.group(1)) < kept_steps[0]):
            continue  # rotated by keep_checkpoints
        lost.append(name + (" (changed)" if name in after else ""))
    return lost


def same_final_state(reference: Path, run: Path) -> tuple[bool, str]:
    """Bitwise: the final checkpoint (model, optimizer, hook memory, method) and the metrics."""
    a, b = ckpt.latest_checkpoint(reference), ckpt.latest_checkpoint(run)
    if a is None or b is None:
        return False, "no final checkpoint"
    (sa, pa), (sb, pb) = a, b
    if pa.name != pb.name:
        return False, f"final checkpoint {pb.name}, expected {pa.name}"
    try:  # tensors with torch.equal, key by key, naming the first differences
        for key in ("model", "optimizer", "hook_states", "method"):
            ckpt.verify_compatible({key: sa[key]}, {key: sb[key]}, what="final state")
    except ckpt.CheckpointError as e:
        return False, str(e)
    rows = [[{k: v for k, v in r.items() if k not in TIMES} for r in _metrics(d)]
            for d in (reference, run)]
    if rows[0] != rows[1]:
        return False, "metrics differ"
    return True, ""


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def damage(path: Path, how: str) -> None:
    if how == "other data":  # a bad copy: another file's bytes under this name
        path.write_bytes(b"\0" * 4096 + os.urandom(4096))
    else:  # bit rot: one bit flipped
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))


# -- the faults ----------------------------------------------------------------------------------


def kill(work: Path, reference: Path, rng: random.Random, i: int) -> Trial:
    during = rng.choice(["step", "step", "save-payload", "save-manifest"])
    if during == "step":
        step, rank = rng.randrange(1, TOTAL), rng.randrange(2)
        where = f"before step {step}, rank {rank}"
    else:
        step, rank = rng.choice(CHECKPOINT_STEPS), 0
        where = f"in the checkpoint write of step {step} ({during.split('-')[1]})"
    run, marker = work / f"kill-{i}", work / f"kill-{i}.marker"
    proc = torchrun(run, restarts=1, fault=fault_env(marker, step, rank, during))
    pid = wait_stopped(marker, proc)
    if pid is None:
        return Trial("kill", where, False, note="fault not reached: " + finish(proc)[1][-300:])
    before = digests(run)
    os.kill(pid, signal.SIGKILL)
    code, out = finish(proc)
    equal, why = same_final_state(reference, run) if code == 0 else (False, out[-400:])
    return Trial("kill", where, code == 0, equal, files_lost(before, run), why)


def disk_full(work: Path, reference: Path, rng: random.Random) -> Trial:
    # Filled just before a step that ends with a mid-epoch checkpoint, not the first one.
    step = rng.choice([s for s in CHECKPOINT_STEPS[1:] if s % STEPS_PER_EPOCH]) - 1
    where = f"filled before step {step}, checkpoint {step + 1} fails"
    disk = work / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs",
                                            str(disk)], capture_output=True).returncode != 0:
        return Trial("disk-full", "skipped: mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        run, marker = disk / "run", work / "disk.marker"
        proc = torchrun(run, fault=fault_env(marker, step))
        pid = wait_stopped(marker, proc)
        if pid is None:
            return Trial("disk-full", where, False, note="fault not reached")
        free = os.statvfs(disk)
        filler = disk / "filler.bin"  # the operator's file, which must survive as well
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - 16 * 1024))
        before, filled = digests(run), digests(disk)["filler.bin"]
        os.kill(pid, signal.SIGCONT)
        code, out = finish(proc)
        failed = code != 0 and "ENOSPC: No space left on device" in out
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        code, out = finish(torchrun(run, "--resume", "auto"))
        equal, why = same_final_state(reference, run) if code == 0 else (False, out[-400:])
        lost = files_lost(before, run) + ([] if digests(disk).get("filler.bin") == filled
                                          else ["filler.bin"])
        note = why if failed else "the write did not fail with ENOSPC as expected; " + why
        return Trial("disk-full", where, failed and code == 0, equal, lost, note)
    finally:
        shutil.copytree(disk, work / "disk-full", ignore=shutil.ignore_patterns("filler.bin"),
                        dirs_exist_ok=True)
        subprocess.run(["umount", str(disk)], check=False)


def freeze(work: Path, reference: Path, rng: random.Random) -> Trial:
    step, rank = rng.randrange(1, TOTAL), rng.randrange(2)
    where = f"SIGSTOP before step {step}, rank {rank}"
    run, marker = work / "freeze", work / "freeze.marker"
    proc = torchrun(run, restarts=1, fault=fault_env(marker, step, rank))
    pid = wait_stopped(marker, proc)
    if pid is None:
        return Trial("freeze", where, False, note="fault not reached")
    frozen_at = time.monotonic()
    before = digests(run)
    code, lines = finish_timed(proc)
    out = "".join(line for _, line in lines)
    detected = [t for t, line in lines
                if re.search(r"pufferfish: error: rank \d lost contact with the other", line)]
    equal, why = same_final_state(reference, run) if code == 0 else (False, out[-400:])
    note = why or (f"PeerError after {detected[0] - frozen_at:.0f} s (--timeout-s {TIMEOUT_S}), "
                   f"recovered {time.monotonic() - frozen_at:.0f} s after the freeze"
                   if detected else "no PeerError line")
    return Trial("freeze", where, bool(detected) and code == 0, equal, files_lost(before, run),
                 note)


def _killed_run(work: Path, name: str, step: int) -> Path:
    """A run SIGKILLed before ``step`` (no restarts): a directory to damage."""
    run, marker = work / name, work / f"{name}.marker"
    proc = torchrun(run, fault=fault_env(marker, step))
    pid = wait_stopped(marker, proc)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    finish(proc)
    return run


def corrupt(work: Path, reference: Path, rng: random.Random) -> Trial:
    step = rng.randrange(2 * EVERY + 1, TOTAL)  # at least two checkpoints exist
    run = _killed_run(work, "corrupt", step)
    newest = max(p for p in ckpt.checkpoint_files(run) if p.suffix == ".pt")
    how = rng.choice(["other data", "bit flip"])
    damage(newest, how)
    where = f"killed before step {step}, {newest.name} damaged ({how})"
    before = digests(run)
    code, out = finish(torchrun(run, "--resume", str(run)))
    fell_back = "skipped checkpoint(s) that do not verify" in out and "resuming from" in out
    equal, why = same_final_state(reference, run) if code == 0 else (False, out[-400:])
    return Trial("corrupt", where, fell_back and code == 0, equal, files_lost(before, run), why)


def corrupt_all(work: Path, rng: random.Random) -> Trial:
    step = rng.randrange(2 * EVERY + 1, TOTAL)
    run = _killed_run(work, "corrupt-all", step)
    damaged = [p for p in ckpt.checkpoint_files(run) if p.suffix == ".pt"]
    for p in damaged:
        damage(p, rng.choice(["other data", "bit flip"]))
    where = f"killed before step {step}, all {len(damaged)} checkpoints damaged"
    before = digests(run)
    result = subprocess.run([sys.executable, "-m", "pufferfish", "train", "--resume", str(run)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stderr.strip().splitlines()
    refused = (result.returncode == 2 and len(lines) == 1 and "verifies" in lines[0]
               and all(str(p) in lines[0] for p in damaged))
    note = "refused in one line naming each file" if refused else result.stderr[-400:]
    after = digests(run)  # a refusal changes nothing at all
    changed = [n + ("" if n in after else " (gone)") for n, d in before.items() if after.get(n) != d]
    return Trial("corrupt-all", where, None, None, changed, note)


# -- the campaign --------------------------------------------------------------------------------


def tally(trials: list[Trial]) -> str:
    lines = ["| fault | where | recovered | final state = uninterrupted | files lost | note |",
             "|---|---|---|---|---|---|"]
    mark = {True: "yes", False: "**NO**", None: "-"}
    for t in trials:
        lines.append(f"| {t.kind} | {t.where} | {mark[t.recovered]} | {mark[t.equal]} | "
                     f"{len(t.lost)}{' ' + ', '.join(t.lost) if t.lost else ''} | {t.note} |")
    run = [t for t in trials if not t.where.startswith("skipped")]
    recoverable = [t for t in run if t.recovered is not None]
    refusals = [t for t in run if t.recovered is None]
    kinds = ", ".join(f"{k} {sum(t.kind == k for t in run)}"
                      for k in dict.fromkeys(t.kind for t in run))
    lines += ["", f"faults injected: {len(run)} ({kinds})",
              f"runs recovered: {sum(bool(t.recovered) for t in recoverable)}/{len(recoverable)}",
              f"final parameters equal to an uninterrupted run (bitwise): "
              f"{sum(bool(t.equal) for t in recoverable)}/{len(recoverable)}",
              f"refused as expected (no checkpoint verifies): "
              f"{sum(t.note.startswith('refused') for t in refusals)}/{len(refusals)}",
              f"files lost: {sum(len(t.lost) for t in run)}"]
    skipped = [t for t in trials if t.where.startswith("skipped")]
    lines += [f"{t.kind}: {t.where}" for t in skipped]
    return "\n".join(lines)


@contextlib.contextmanager
def workdir(path: str | None, keep: bool) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=False)
        yield Path(path)
        return
    tmp = Path(tempfile.mkdtemp(prefix="pufferfish-faults-"))
    try:
        yield tmp
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs at random points (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="chooses the fault points")
    ap.add_argument("--workdir", help="a new directory for the runs (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the default temp dir")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    with workdir(args.workdir, args.keep) as work:
        print(f"fault campaign in {work}: seed {args.seed}, {args.kills} kills", flush=True)
        reference = work / "uninterrupted"
        code, out = finish(torchrun(reference))
        if code != 0:
            print(out[-3000:])
            return 1
        trials = []
        faults = [lambda i=i: kill(work, reference, rng, i) for i in range(args.kills)]
        faults += [lambda: disk_full(work, reference, rng), lambda: freeze(work, reference, rng),
                   lambda: corrupt(work, reference, rng), lambda: corrupt_all(work, rng)]
        for fault in faults:
            trial = fault()
            trials.append(trial)
            print(f"  {trial.kind}: {trial.where}: recovered {trial.recovered}, equal "
                  f"{trial.equal}, lost {len(trial.lost)} {trial.note}", flush=True)
        print()
        print(tally(trials))
        print(f"\n({time.monotonic() - started:.0f} s)")
    ok = all(t.recovered is not False and t.equal is not False and not t.lost for t in trials)
    refusals_ok = all(t.note.startswith("refused") for t in trials if t.recovered is None
                      and not t.where.startswith("skipped"))
    return 0 if ok and refusals_ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
