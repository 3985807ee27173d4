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
Ctrl-C (``with`` unwinding), at interpreter exit (``atexit``) and on SIGTERM
(:mod:`.cleanup`).
Namespaces are named ``pf-<pid>-<random>-<i>`` so concurrent runs never collide and
:func:`cleanup_stale` can tell which ones were orphaned by a dead process.

Only two endpoints (a point-to-point link) are supported: the benchmark runs two
ranks, and a bridge namespace for more workers would add complexity nobody uses yet.

Requires root plus ``ip``/``tc`` (Debian package ``iproute2``);
:func:`netns_available` reports why emulation cannot run so callers can skip the
emulated conditions with a clear message rather than silently measuring loopback.
Ranks are launched on a link by :mod:`.workers`; :mod:`.probe` measures what it delivers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from .bandwidth import format_bps
from .cleanup import install_handlers, live_links

__all__ = ["EmulatedLink", "cleanup_stale", "netem_available", "netns_available", "qdisc_commands"]

NS_PREFIX = "pf-"
_NS_RE = re.compile(r"^pf-(\d+)-([0-9a-f]+)-(\w+)$")


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
# the link
# ---------------------------------------------------------------------------


def _tc_rate(bps: int) -> str:
    """Rate in tc syntax; plain ``<n>bit`` is exact and unambiguous."""
    return f"{bps}bit"


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


def qdisc_commands(ns: str, ifname: str, rate_bps: int, delay_ms: float) -> list[list[str]]:
    """The ``tc`` commands that shape one veth end's egress: ``tbf`` at ``rate_bps``, behind a
    ``netem`` one-way delay of ``delay_ms`` when it is > 0 (netem delays first, then tbf, netem's
    only child at class 1:1, shapes). Each end shapes its own egress, so both directions get
    rate + delay (a round trip of 2 x ``delay_ms``)."""
    burst, latency_ms = _tbf_params(rate_bps, delay_ms)
    tbf = f"tbf rate {_tc_rate(rate_bps)} burst {burst} latency {latency_ms:g}ms".split()
    qdisc = f"tc -n {ns} qdisc add dev {ifname}".split()
    if delay_ms <= 0:
        return [[*qdisc, "root", *tbf]]
    return [[*qdisc, *f"root handle 1: netem delay {delay_ms:g}ms limit 100000".split()],
            [*qdisc, "parent", "1:1", "handle", "10:", *tbf]]


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
        install_handlers()
        live_links.add(self)
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
        for name, ifname, addr in zip(ns, ifs, self.addresses):
            _run(f"ip -n {name} addr add {addr}/{self.prefixlen} dev {ifname}".split())
            _run(f"ip -n {name} link set {ifname} up".split())
            for argv in qdisc_commands(name, ifname, self.rate_bps, self.delay_ms):
                _run(argv)
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
        live_links.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- running things on an endpoint --------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside endpoint ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def env(self, i: int) -> dict[str, str]:
        """Environment that pins gloo, tensorpipe and NCCL to endpoint ``i``'s veth."""
        return {"GLOO_SOCKET_IFNAME": self.interfaces[i], "TP_SOCKET_IFNAME": self.interfaces[i],
                "NCCL_SOCKET_IFNAME": self.interfaces[i]}

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

