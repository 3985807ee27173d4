"""What the bench still has running (emulated links, worker processes), torn down at exit.

One registry that both :mod:`.netns` (links) and :mod:`.workers` (ranks) add to: at
interpreter exit (``atexit``) and on SIGTERM, running workers are killed first, then
every open link's namespaces are deleted.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Protocol

__all__ = ["install_handlers", "kill_running", "live_links", "live_procs"]


class _Closable(Protocol):
    def close(self) -> None: ...


live_links: weakref.WeakSet[_Closable] = weakref.WeakSet()
live_procs: set[subprocess.Popen[bytes]] = set()
_registry_lock = threading.Lock()
_handlers_installed = False
_prev_sigterm: Callable[[int, FrameType | None], object] | int | None = None


def kill_running(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every worker that has not been reaped yet.

    Each worker leads its own session, so this reaches its children (e.g. data loader
    workers) but nothing else; already-reaped workers are skipped so a recycled pid
    can never be hit.
    """
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def _cleanup_all() -> None:
    """Kill running workers, then delete every open link's namespaces."""
    kill_running(list(live_procs))
    for link in list(live_links):
        with contextlib.suppress(Exception):
            link.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Tear down our namespaces, then behave as the previous SIGTERM handler would."""
    _cleanup_all()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    # Default action: die by SIGTERM, so the exit status still says "terminated".
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install_handlers() -> None:
    """Register the teardown with ``atexit`` and for SIGTERM, once per process."""
    global _handlers_installed, _prev_sigterm
    with _registry_lock:
        if _handlers_installed:
            return
        atexit.register(_cleanup_all)
        # signal.signal only works from the main thread; elsewhere atexit + `with`
        # still cover normal exit, errors and KeyboardInterrupt.
        if threading.current_thread() is threading.main_thread():
            _prev_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
        _handlers_installed = True
