"""Emulated bandwidth-limited links for the distributed benchmark.

Pufferfish's claim is about *communication*: a low-rank model ships fewer gradient
bytes, which only shows up as wall-clock savings when the network is the bottleneck.
On one machine every gloo worker talks over loopback (several Gbit/s), so the
benchmark would measure nothing interesting.  This module builds a real, slow link
instead of faking one:

* two Linux network namespaces (one per rank), joined by a veth pair;
* a ``tbf`` token-bucket qdisc on *both* veth ends, so each direction is limited to
  the requested rate (optionally with a ``netem`` one-way delay in front of it);
* each worker is started with ``ip netns exec`` in its namespace and gloo is pinned to
  the veth interface with ``GLOO_SOCKET_IFNAME``.

Only addresses inside namespaces we create ourselves are used (a random
``10.213.X.0/30``), and every namespace is deleted again on normal exit, on error, on
Ctrl-C (``with`` unwinding), at interpreter exit (``atexit``) and on SIGTERM.
Namespaces are named ``pf-<pid>-<random>-<i>`` so concurrent runs never collide and
:func:`cleanup_stale` can tell which ones were orphaned by a dead process.

Only two endpoints (a point-to-point link) are supported: the benchmark runs two
ranks, and a bridge namespace for more workers would add complexity nobody uses yet.

Requires root plus ``ip``/``tc`` (Debian package ``iproute2``);
:func:`netns_available` reports why emulation cannot run so callers can skip the
emulated conditions with a clear message rather than silently measuring loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

__all__ = [
    "EmulatedLink",
    "ProbeResult",
    "WorkerTimeout",
    "cleanup_stale",
    "format_bps",
    "free_port",
    "measure_throughput",
    "netem_available",
    "netns_available",
    "parse_bandwidth",
    "run_probe",
    "run_workers",
]

NS_PREFIX = "pf-"
_NS_RE = re.compile(r"^pf-(\d+)-([0-9a-f]+)-(\w+)$")
_BW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g|t)?(bit|bps)\s*$", re.IGNORECASE)
_BW_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BW_FORM = (
    "'loopback' or <number><unit> with unit in bit/kbit/mbit/gbit/tbit (e.g. '100mbit', '1gbit')"
)

# Fixed port for rank 0 inside a fresh namespace: each namespace has its own port
# space, so nothing else can be listening there.
_NETNS_MASTER_PORT = 29500


# ---------------------------------------------------------------------------
# bandwidth strings
# ---------------------------------------------------------------------------


def parse_bandwidth(text: str) -> int | None:
    """Parse a link rate as used on the command line into bits per second.

    ``"loopback"`` (aliases ``lo``/``none``/``unlimited``) means "no emulation" and
    returns ``None``; ``"100mbit"``,
    ``"1gbit"``, ``"500kbit"``, ``"10gbit"`` (tc's decimal units, case-insensitive)
    return integers.  ``"100mbps"`` is rejected on purpose: tc reads ``bps`` as
    *bytes* per second, so accepting it either way would invite an 8x mistake.
    """
    if not isinstance(text, str):
        raise ValueError(f"invalid bandwidth {text!r}: expected {_BW_FORM}")
    s = text.strip().lower()
    if s in ("loopback", "lo", "none", "unlimited"):
        return None
    m = _BW_RE.match(s)
    if m is not None and m.group(3).lower() == "bps":
        raise ValueError(
            f"invalid bandwidth {text!r}: 'bps' is ambiguous (tc reads it as bytes/s); "
            f"expected {_BW_FORM}"
        )
    if m is None:
        raise ValueError(f"invalid bandwidth {text!r}: expected {_BW_FORM}")
    value = float(m.group(1)) * _BW_UNITS[(m.group(2) or "").lower()]
    bps = round(value)
    if bps < 8_000:
        # tbf cannot shape meaningfully below ~1 kB/s and gloo would time out anyway.
        raise ValueError(f"invalid bandwidth {text!r}: rate must be at least 8kbit ({_BW_FORM})")
    return bps


def format_bps(bps: float) -> str:
    """Human-readable bits/s (``94.1 Mbit/s``) for benchmark output."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def _tc_rate(bps: int) -> str:
    """Rate in tc syntax; plain ``<n>bit`` is exact and unambiguous."""
    return f"{bps}bit"


# ---------------------------------------------------------------------------
# small helpers around `ip`
# ---------------------------------------------------------------------------


def _run(
    argv: Sequence[str], check: bool = True, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}"
        )
    return proc


def _list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    proc = _run(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    # Lines look like "pf-123-ab12cd-0 (id: 4)" or just "name".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _delete_netns(name: str) -> None:
    """Delete a namespace, killing anything still running inside it first.

    A namespace whose processes are still alive would keep the veth (and its shaped
    link) alive after ``ip netns del`` removes the name, so we SIGKILL them.  Only
    processes *inside our own namespace* are touched.
    """
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", name], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove ``pf-*`` namespaces left behind by processes that died (e.g. SIGKILL).

    A namespace is considered stale only if the pid encoded in its name is dead *and*
    no process is running inside it, so a concurrent run is never disturbed.  Returns
    the deleted names.
    """
    removed: list[str] = []
    for name in _list_netns():
        m = _NS_RE.match(name)
        if m is None:
            continue
        if _pid_alive(int(m.group(1))):
            continue
        if _run(["ip", "netns", "pids", name], check=False).stdout.strip():
            continue
        _delete_netns(name)
        removed.append(name)
    return removed


def _try_steps(steps: Callable[[str], list[list[str]]]) -> str | None:
    """Run setup commands in a throw-away namespace; first failure as one line."""
    ns = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        for argv in [["ip", "netns", "add", ns], *steps(ns)]:
            try:
                proc = _run(argv, check=False, timeout=15)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"cannot run {' '.join(argv[:4])}: {exc}"
            if proc.returncode != 0:
                err = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
                return f"`{' '.join(argv)}` failed: {err}"
        return None
    finally:
        with contextlib.suppress(Exception):
            _delete_netns(ns)


@functools.lru_cache(maxsize=1)
def netns_available() -> str | None:
    """Return ``None`` if link emulation can run here, else a one-line reason.

    We actually try it (namespace, veth, tbf, ``ip netns exec``) instead of guessing:
    containers often run as root but lack CAP_NET_ADMIN, the ``sch_tbf`` module, or
    the mount privileges ``ip netns exec`` needs.  Cached, since the answer does not
    change during a process's lifetime.
    """
    if sys.platform != "linux":
        return f"network namespaces need Linux (platform is {sys.platform})"
    if os.geteuid() != 0:
        return "network emulation needs root (creating namespaces/qdiscs requires CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{'/'.join(missing)} not found (install the iproute2 package)"
    veth = ["link", "add", "pfprobe0", "type", "veth", "peer", "name", "pfprobe1"]
    tbf = ["root", "tbf", "rate", "100mbit", "burst", "128kb", "latency", "50ms"]
    return _try_steps(
        lambda ns: [
            ["ip", "-n", ns, *veth],
            ["tc", "-n", ns, "qdisc", "add", "dev", "pfprobe0", *tbf],
            ["ip", "netns", "exec", ns, "true"],
        ]
    )


@functools.lru_cache(maxsize=1)
def netem_available() -> str | None:
    """Like :func:`netns_available`, for ``delay_ms > 0`` (needs the sch_netem module).

    Minimal VM kernels often ship tbf but not netem; callers should skip delayed
    conditions with this reason rather than silently run them without delay.
    """
    reason = netns_available()
    if reason is not None:
        return reason
    reason = _try_steps(
        lambda ns: [["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]]
    )
    return (
        None if reason is None else f"netem delay unavailable (kernel lacks sch_netem?): {reason}"
    )


# ---------------------------------------------------------------------------
# process-wide cleanup registry (atexit + SIGTERM)
# ---------------------------------------------------------------------------

_live_links: weakref.WeakSet[EmulatedLink] = weakref.WeakSet()
_registry_lock = threading.Lock()
_handlers_installed = False
_prev_sigterm: Callable[[int, FrameType | None], object] | int | None = None


_live_procs: set[subprocess.Popen[bytes]] = set()


def _cleanup_all() -> None:
    """Kill running workers, then delete every open link's namespaces."""
    _kill_running(list(_live_procs))
    for link in list(_live_links):
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


def _install_handlers() -> None:
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


# ---------------------------------------------------------------------------
# the link
# ---------------------------------------------------------------------------


def _tbf_params(rate_bps: int, delay_ms: float) -> tuple[int, float]:
    """Choose tbf ``burst`` (bytes) and ``latency`` (ms) for a rate.

    burst: the bucket must hold at least one whole packet as the *kernel* sees it.
    veth does GSO/TSO, so TCP hands tbf "super-packets" of up to 64 KiB; a bucket
    smaller than that forces tbf to software-segment every one (CPU-bound at 1gbit on a
    small machine) and a bucket much smaller than MTU drops everything.  A bucket also
    has to cover the timer/softirq wake-up jitter: if the dequeue runs late, tokens
    beyond the bucket are lost and the rate sags.  2 ms worth of tokens (250 KB at
    1gbit) with a 128 KiB floor reaches ~the configured rate at 100mbit-1gbit while the
    overshoot (one bucket per idle period) stays far below 1% of a multi-MB all-reduce.
    Measured on a 2-core VM (100 MB all-reduce at 1gbit): burst 16 kB -> 55% of the
    rate, 128-250 KB -> 92-95%; at 100mbit 16-25 kB -> 86-87%, 128 KB -> 94%.  Note
    tbf counts whole Ethernet frames (1514 B per 1448 B of TCP payload), so ~95.5% is
    the ceiling for all-reduce payload throughput.

    latency: the maximum time a packet may wait in tbf's queue, i.e. the queue size
    ``rate*latency + burst``.  Too small and TCP sees drops and backs off (throughput
    well below the rate); too large only adds bufferbloat.  50 ms (625 KB at 100mbit)
    plus the round-trip delay keeps TCP's window fitting in the queue.
    """
    burst = max(128 * 1024, int(rate_bps / 8 * 0.002))
    latency_ms = 50.0 + 2.0 * delay_ms
    return burst, latency_ms


class EmulatedLink:
    """A point-to-point link of ``rate_bps`` between two fresh network namespaces.

    Use as a context manager; inside it ``command(i, argv)`` and ``env(i)`` run a
    program as endpoint ``i``.  ``delay_ms`` adds a ``netem`` one-way delay in each
    direction (RTT = 2*delay).  Only ``n_endpoints=2`` is supported.
    """

    def __init__(self, rate_bps: int, delay_ms: float = 0.0, n_endpoints: int = 2) -> None:
        if n_endpoints != 2:
            raise ValueError(f"EmulatedLink supports exactly 2 endpoints, got {n_endpoints}")
        if int(rate_bps) <= 0:
            raise ValueError(f"rate_bps must be positive, got {rate_bps}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.rate_bps = int(rate_bps)
        self.delay_ms = float(delay_ms)
        self.n_endpoints = n_endpoints
        token = secrets.token_hex(3)
        pid = os.getpid()
        self.namespaces: list[str] = [f"{NS_PREFIX}{pid}-{token}-{i}" for i in range(n_endpoints)]
        # IFNAMSIZ is 16 incl. NUL: "pfv" + 6 hex + "-" + i fits; the random token keeps
        # them unique anyway, so concurrent links can never clash on a name.
        self.interfaces: list[str] = [f"pfv{token}-{i}" for i in range(n_endpoints)]
        subnet = secrets.randbelow(256)
        self.addresses: list[str] = [f"10.213.{subnet}.{i + 1}" for i in range(n_endpoints)]
        self.prefixlen = 30
        self._created: list[str] = []
        self._closed = False
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------

    def __enter__(self) -> EmulatedLink:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> None:
        """Create namespaces, veth pair, addresses and qdiscs (cleans up on failure)."""
        reason = netem_available() if self.delay_ms > 0 else netns_available()
        if reason is not None:
            raise RuntimeError(f"cannot emulate link: {reason}")
        _install_handlers()
        _live_links.add(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        ns, ifs = self.namespaces, self.interfaces
        for name in ns:
            self._created.append(name)  # record first: a half-created ns is still deleted
            _run(["ip", "netns", "add", name])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        # Both veth ends are created directly inside their namespaces, so the host's
        # root namespace never sees them.  (All names are ours and contain no spaces,
        # which makes the str.split() command lines below safe.)
        _run(
            f"ip link add name {ifs[0]} netns {ns[0]} type veth peer name {ifs[1]} netns {ns[1]}".split()
        )
        burst, latency_ms = _tbf_params(self.rate_bps, self.delay_ms)
        tbf = f"tbf rate {_tc_rate(self.rate_bps)} burst {burst} latency {latency_ms:g}ms".split()
        for name, ifname, addr in zip(ns, ifs, self.addresses):
            _run(f"ip -n {name} addr add {addr}/{self.prefixlen} dev {ifname}".split())
            _run(f"ip -n {name} link set {ifname} up".split())
            qdisc = f"tc -n {name} qdisc add dev {ifname}".split()
            if self.delay_ms > 0:
                # netem delays first, then tbf (netem's only child, class 1:1) shapes.
                # Each end shapes its own egress, so both directions get rate + delay.
                _run(
                    [
                        *qdisc,
                        *f"root handle 1: netem delay {self.delay_ms:g}ms limit 100000".split(),
                    ]
                )
                _run([*qdisc, "parent", "1:1", "handle", "10:", *tbf])
            else:
                _run([*qdisc, "root", *tbf])
        # The kernel reports carrier asynchronously (linkwatch); wait for both ends to be
        # UP so a worker that connects immediately does not race the link coming up.
        deadline = time.monotonic() + 5.0
        for name, ifname in zip(ns, ifs):
            while " UP " not in _run(f"ip -n {name} -br link show dev {ifname}".split()).stdout:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"veth {ifname} in {name} did not come up")
                time.sleep(0.02)

    def close(self) -> None:
        """Delete everything this link created.  Idempotent and thread-safe."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            created, self._created = self._created, []
        # Deleting a namespace destroys the veth end inside it (and thereby its peer).
        for name in created:
            with contextlib.suppress(Exception):
                _delete_netns(name)
        _live_links.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- running things on an endpoint --------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside endpoint ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def env(self, i: int) -> dict[str, str]:
        """Environment that pins gloo (and tensorpipe) to endpoint ``i``'s veth."""
        return {"GLOO_SOCKET_IFNAME": self.interfaces[i], "TP_SOCKET_IFNAME": self.interfaces[i]}

    def describe(self) -> str:
        s = f"emulated {format_bps(self.rate_bps)} veth link"
        if self.delay_ms:
            s += f", {self.delay_ms:g} ms one-way delay"
        return s

    def __repr__(self) -> str:
        return (
            f"EmulatedLink(rate_bps={self.rate_bps}, delay_ms={self.delay_ms}, "
            f"namespaces={self.namespaces}, closed={self._closed})"
        )


# ---------------------------------------------------------------------------
# launching workers
# ---------------------------------------------------------------------------


class WorkerTimeout(subprocess.TimeoutExpired):
    """All workers were killed because they did not finish within ``timeout``.

    ``results`` holds the (killed) workers' CompletedProcess objects with whatever
    they printed, which is usually what you need to see why they hung.
    """

    def __init__(
        self, cmd: list[str], timeout: float, results: list[subprocess.CompletedProcess[str]]
    ) -> None:
        tail = "\n".join(f"[rank {r}] {p.stderr[-2000:]}" for r, p in enumerate(results))
        super().__init__(cmd, timeout, output=None, stderr=tail)
        self.results = results

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for the loopback condition)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_running(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the process group of every worker that has not been reaped yet.

    Each worker leads its own session, so this reaches its children (e.g. data loader
    workers) but nothing else; already-reaped workers are skipped so a recycled pid
    can never be hit.
    """
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def run_workers(
    link: EmulatedLink | None,
    argv_for_rank: Callable[[int], list[str]],
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    world_size: int = 2,
    fail_fast_grace: float = 5.0,
) -> list[subprocess.CompletedProcess[str]]:
    """Run one process per rank, each in its namespace, wired up for torch.distributed.

    Every rank gets ``MASTER_ADDR`` (endpoint 0), ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK=0`` and ``GLOO_SOCKET_IFNAME``.  With ``link=None``
    the same thing runs on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``) so the benchmark has a
    single code path for loopback and emulated conditions.

    If a rank exits non-zero the others would block in a collective until gloo's
    30-minute timeout, so they are killed after ``fail_fast_grace`` seconds.  On
    ``timeout`` all ranks are killed and :class:`WorkerTimeout` is raised; on
    KeyboardInterrupt all ranks are killed and the interrupt propagates.  Returns one
    CompletedProcess per rank (stdout/stderr captured as text); the caller checks
    ``returncode``.
    """
    master_addr, port, world_size = _rendezvous(link, master_port, world_size)
    _install_handlers()  # SIGTERM/atexit also kill loopback workers
    workers: list[_Worker] = []
    with contextlib.ExitStack() as files:
        try:
            for rank in range(world_size):
                argv = _worker_argv(rank, argv_for_rank, link)
                wenv = _worker_env(rank, world_size, master_addr, port, link, env)
                # Temp files, not pipes: a chatty worker can never block on a full pipe.
                out = files.enter_context(tempfile.TemporaryFile())
                err = files.enter_context(tempfile.TemporaryFile())
                workers.append(_start_worker(argv, wenv, out, err))
            timed_out = _wait_for_exit([w.proc for w in workers], timeout, fail_fast_grace)
        except BaseException:  # KeyboardInterrupt included: never leave ranks behind
            _kill_and_reap([w.proc for w in workers])
            raise
        finally:
            _live_procs.difference_update([w.proc for w in workers])
        results = [w.result() for w in workers]
    if timed_out:
        raise WorkerTimeout(workers[0].argv, timeout, results)
    return results


def _rendezvous(
    link: EmulatedLink | None, master_port: int | None, world_size: int
) -> tuple[str, int, int]:
    """``(MASTER_ADDR, MASTER_PORT, world size)``: the link's endpoint 0, or loopback."""
    if link is None:
        port = master_port if master_port is not None else free_port()
        return "127.0.0.1", port, world_size
    if link.closed:
        raise RuntimeError("EmulatedLink is closed")
    port = master_port if master_port is not None else _NETNS_MASTER_PORT
    return link.addresses[0], port, link.n_endpoints


def _worker_argv(
    rank: int, argv_for_rank: Callable[[int], list[str]], link: EmulatedLink | None
) -> list[str]:
    """The rank's command, wrapped to run inside its namespace when there is a link."""
    argv = list(argv_for_rank(rank))
    return link.command(rank, argv) if link is not None else argv


def _worker_env(
    rank: int,
    world_size: int,
    master_addr: str,
    port: int,
    link: EmulatedLink | None,
    env: Mapping[str, str] | None,
) -> dict[str, str]:
    """This environment, then ``env``, then the torch.distributed variables and interface."""
    wenv = dict(os.environ)
    if env:
        wenv.update(env)
    wenv.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
    )
    if link is not None:
        wenv.update(link.env(rank))
    else:
        wenv.update({"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"})
    return wenv


@dataclass
class _Worker:
    """One launched rank: its command, its process and the files holding its output."""

    argv: list[str]
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]

    def result(self) -> subprocess.CompletedProcess[str]:
        """The finished (or killed) rank's exit code and output, decoded as text."""
        self.out.seek(0)
        self.err.seek(0)
        stdout = self.out.read().decode(errors="replace")
        stderr = self.err.read().decode(errors="replace")
        return subprocess.CompletedProcess(self.argv, int(self.proc.returncode), stdout, stderr)


def _start_worker(argv: list[str], wenv: dict[str, str], out: IO[bytes], err: IO[bytes]) -> _Worker:
    """Launch one rank in its own session (so it can be killed with its children)."""
    proc = subprocess.Popen(
        argv, env=wenv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
    )
    _live_procs.add(proc)
    return _Worker(argv, proc, out, err)


def _wait_for_exit(
    procs: Sequence[subprocess.Popen[bytes]], timeout: float, fail_fast_grace: float
) -> bool:
    """Wait until every rank has exited; return whether ``timeout`` ran out first.

    Once a rank has failed, the rest are killed after ``fail_fast_grace`` seconds; at the
    deadline all are killed and reaped.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > fail_fast_grace:
            _kill_running(procs)
        if now > deadline:
            _kill_and_reap(procs, timeout=None)
            return True
        time.sleep(0.02)


def _kill_and_reap(procs: Sequence[subprocess.Popen[bytes]], timeout: float | None = 10) -> None:
    """Kill every running rank and wait for it (``timeout`` seconds each, if not ``None``)."""
    _kill_running(procs)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=timeout)


# ---------------------------------------------------------------------------
# self-check: measure what the link actually delivers
# ---------------------------------------------------------------------------

_PROBE = Path(__file__).with_name("_probe.py")


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one all-reduce probe (see :func:`run_probe`)."""

    nbytes: int
    seconds: float
    bus_bps: float
    correct: bool
    world_size: int


def run_probe(
    link: EmulatedLink | None,
    nbytes: int = 25_000_000,
    iters: int = 1,
    timeout: float = 120.0,
) -> ProbeResult:
    """Time a gloo all_reduce of ``nbytes`` across the link and verify its result.

    Bus bandwidth follows the nccl-tests convention, ``busbw = size/time *
    2(n-1)/n``: it is the per-rank, per-direction link rate a ring all-reduce
    achieves, so it is directly comparable with the emulated rate.
    """
    results = run_workers(
        link,
        lambda rank: [sys.executable, str(_PROBE), "--nbytes", str(nbytes), "--iters", str(iters)],
        timeout=timeout,
    )
    bad = [(r, p) for r, p in enumerate(results) if p.returncode != 0]
    if bad:
        msg = "; ".join(
            f"rank {r} exited {p.returncode}: {p.stderr.strip()[-1500:]}" for r, p in bad
        )
        raise RuntimeError(f"all-reduce probe failed: {msg}")
    reports = []
    for r, p in enumerate(results):
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"all-reduce probe rank {r} printed no result: {p.stdout!r}")
        reports.append(json.loads(lines[-1]))
    world = len(results)
    seconds = max(float(rep["seconds"]) for rep in reports)
    size = int(reports[0]["nbytes"])
    bus_bps = size * 8 * iters / seconds * 2 * (world - 1) / world
    correct = all(bool(rep["correct"]) for rep in reports)
    return ProbeResult(
        nbytes=size, seconds=seconds, bus_bps=bus_bps, correct=correct, world_size=world
    )


def measure_throughput(link: EmulatedLink | None, nbytes: int = 25_000_000) -> float:
    """Achieved all-reduce bus bandwidth (bits/s) over ``link`` (``None`` = loopback).

    Lets the benchmark print "emulated 100mbit, measured 94 Mbit/s" so that a
    misconfigured (or unshaped) link is visible instead of silently skewing results.
    Raises if the all-reduce result is wrong.
    """
    res = run_probe(link, nbytes=nbytes)
    if not res.correct:
        raise RuntimeError("all-reduce probe returned a wrong result")
    return res.bus_bps


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m pufferfish.bench.netns 100mbit 1gbit``: measure emulated links."""
    import argparse

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("rates", nargs="*", default=["100mbit", "1gbit"])
    ap.add_argument("--nbytes", type=int, default=25_000_000)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    stale = cleanup_stale()
    if stale:
        print(f"removed stale namespaces: {', '.join(stale)}")
    for text in args.rates:
        rate = parse_bandwidth(text)
        if rate is None:
            res = run_probe(None, nbytes=args.nbytes)
            print(
                f"loopback: measured {format_bps(res.bus_bps)} all-reduce bus bandwidth "
                f"({res.seconds:.3f} s, correct={res.correct})"
            )
            continue
        reason = netem_available() if args.delay_ms > 0 else netns_available()
        if reason is not None:
            print(f"{text}: skipped ({reason})")
            continue
        with EmulatedLink(rate, delay_ms=args.delay_ms) as link:
            res = run_probe(link, nbytes=args.nbytes)
        print(
            f"emulated {text}: measured {format_bps(res.bus_bps)} all-reduce bus bandwidth "
            f"({res.bus_bps / rate:.0%} of rate, {res.seconds:.3f} s, correct={res.correct})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
