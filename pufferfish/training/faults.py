"""Fault injection for the tests and ``benchmarks/faults.sh``, armed by environment variables.

Unarmed (no ``PUFFERFISH_KILL_AT_STEP``), every call is one dictionary lookup. Armed:

* ``PUFFERFISH_KILL_AT_STEP=N``: the global step the fault belongs to;
* ``PUFFERFISH_KILL_DURING``: where it strikes. ``step`` (default): before step N, on rank
  ``PUFFERFISH_KILL_RANK`` (default 0). ``save-payload``: while rank 0 writes the checkpoint of
  step N, the payload complete in its temp file but not yet renamed. ``save-manifest``: the
  payload renamed into place, its manifest not yet written (a checkpoint without a manifest);
* ``PUFFERFISH_KILL_SIGNAL``: ``KILL`` (default), or ``STOP`` to freeze the process instead (a peer
  that hangs with its sockets open, the case only the process-group timeout catches);
* ``PUFFERFISH_KILL_MARKER``: a file created just before the signal, so that a restarted worker is
  not hit again at the same point (default ``pufferfish-killed.marker``). It holds the point, the
  step and the process id (a driver that froze the process finds it there: ``wait_stopped``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["strike", "wait_stopped"]

POINTS = ("step", "save-payload", "save-manifest")


def strike(point: str, global_step: int, rank: int = 0) -> None:
    """Signal this process if the armed fault is at ``point`` of ``global_step`` on ``rank``."""
    at = os.environ.get("PUFFERFISH_KILL_AT_STEP")
    if at is None or int(at) != global_step:
        return
    if os.environ.get("PUFFERFISH_KILL_DURING", "step") != point:
        return
    if rank != int(os.environ.get("PUFFERFISH_KILL_RANK", "0")):
        return
    marker = Path(os.environ.get("PUFFERFISH_KILL_MARKER", "pufferfish-killed.marker"))
    if marker.exists():
        return
    marker.write_text(f"{point} {global_step} {os.getpid()}\n")
    os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("PUFFERFISH_KILL_SIGNAL", "KILL")))


def wait_stopped(marker: Path, proc: subprocess.Popen, timeout: float = 300) -> int | None:
    """The pid of the worker that froze itself (``PUFFERFISH_KILL_SIGNAL=STOP``) at the armed
    point, once it is stopped; None if ``proc`` (its launcher) ended first or ``timeout`` passed.
    A driver records what it needs (the run directory's files) and then delivers the real fault."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = marker.read_text().split() if marker.exists() else []
        if len(fields) == 3:
            pid = int(fields[2])
            with contextlib.suppress(FileNotFoundError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state in ("T", "t"):
                    return pid
        elif proc.poll() is not None:
            return None
        time.sleep(0.02)
    return None
