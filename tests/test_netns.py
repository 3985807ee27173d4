"""Tests for the emulated links and their helpers (``pufferfish.bench``: bandwidth, netns,
workers, probe).

The namespace tests need root + iproute2; elsewhere they are skipped with the reason
``netns_available()`` gives, never faked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, port_slice

from pufferfish.bench.bandwidth import format_bps, parse_bandwidth
from pufferfish.bench.netns import EmulatedLink, cleanup_stale, netns_available
from pufferfish.bench.probe import run_probe
from pufferfish.bench.workers import WorkerTimeout, run_workers

MBIT = 10**6


def _our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefix = f"pf-{os.getpid()}-"
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix)]


def _named(namespace: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return namespace in [ln.split()[0] for ln in out.splitlines() if ln.strip()]


needs_netns = pytest.mark.skipif(
    netns_available() is not None, reason=f"link emulation unavailable: {netns_available()}"
)


# ---------------------------------------------------------------------------
# parse_bandwidth / format_bps (no privileges needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("loopback", None),
        ("LOOPBACK", None),
        ("10gbit", 10 * 10**9),
        ("1gbit", 10**9),
        ("100mbit", 100 * MBIT),
        (" 100Mbit ", 100 * MBIT),
        ("500kbit", 500_000),
        ("2.5gbit", 2_500_000_000),
        ("64000bit", 64_000),
    ],
)
def test_parse_bandwidth(text: str, expected: int | None) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize(
    "text", ["", "fast", "100", "100mb", "100mbps", "-1gbit", "1 gigabit", "1bit"]
)
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bandwidth(text)
    msg = str(info.value)
    assert repr(text) in msg
    assert "100mbit" in msg  # names the allowed form


def test_format_bps() -> None:
    assert format_bps(94.1e6) == "94.1 Mbit/s"
    assert format_bps(1.5e9) == "1.5 Gbit/s"


# ---------------------------------------------------------------------------
# run_workers on loopback (no privileges needed)
# ---------------------------------------------------------------------------

_ENV_DUMP = (
    "import os; print(' '.join(os.environ[k] for k in "
    "('MASTER_ADDR','RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','GLOO_SOCKET_IFNAME')))"
)


def test_run_workers_loopback_env() -> None:
    # The ranks are one machine's processes (LOCAL_RANK of LOCAL_WORLD_SIZE, as torchrun's), so
    # that on GPUs each takes its own (distributed.env.pick_device), not all of them GPU 0.
    res = run_workers(
        None, lambda r: [sys.executable, "-c", _ENV_DUMP], master_port=12345, timeout=30,
        world_size=3,
    )
    assert [p.returncode for p in res] == [0, 0, 0]
    assert [p.stdout.split() for p in res] == [
        ["127.0.0.1", str(r), "3", str(r), "3", "lo"] for r in range(3)
    ]


_GROUP = """
import os, socket
import torch, torch.distributed as dist
from pufferfish.distributed.env import cleanup, exit_process
with socket.socket() as s:  # the rendezvous port is held for the ranks, not merely found free
    taken = s.connect_ex(("127.0.0.1", int(os.environ["MASTER_PORT"]))) == 0
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(taken, int(t))
cleanup()
exit_process(0)
"""


def test_two_loopback_groups_at_once_each_rendezvous_on_a_held_port() -> None:
    """Without a given port the launching process hosts the store on a port the kernel holds
    for it (torchrun's agent store): two launches at once, each a real gloo group."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(_: int) -> list[subprocess.CompletedProcess[str]]:
        return run_workers(None, lambda r: [sys.executable, "-c", _GROUP], timeout=120)

    with ThreadPoolExecutor(2) as pool:
        launches = list(pool.map(launch, range(2)))
    for res in launches:
        assert [p.returncode for p in res] == [0, 0], [p.stderr[-2000:] for p in res]
        assert [p.stdout.split() for p in res] == [["True", "3"], ["True", "3"]]


def test_a_given_port_is_rank_0s_even_under_an_agent_store_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a port given (and in a link's namespace) rank 0 hosts the store, whatever the
    launching process inherited from a torchrun of its own: no rank waits for an absent host."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    res = run_workers(None, lambda r: [sys.executable, "-c", _GROUP], master_port=free_port(),
                      timeout=120)
    assert [p.returncode for p in res] == [0, 0], [p.stderr[-2000:] for p in res]
    assert [p.stdout.split()[1] for p in res] == ["3", "3"]


def test_the_tests_own_ports_are_apart_per_worker_and_never_the_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not kernel.is_file():
        pytest.skip("the kernel's ephemeral range is Linux's /proc")
    low, high = map(int, kernel.read_text().split())
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(port_slice()))
    assert len(slices[0]) > 1000 and len(slices[1]) > 1000 and not slices[0] & slices[1]
    assert not (slices[0] | slices[1]) & set(range(low, high + 1))


def test_run_workers_timeout_kills_all() -> None:
    with pytest.raises(WorkerTimeout) as info:
        run_workers(
            None, lambda r: [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1
        )
    assert all(p.returncode != 0 for p in info.value.results)


def test_run_workers_fail_fast() -> None:
    def argv(rank: int) -> list[str]:
        code = "import sys; sys.exit(3)" if rank == 0 else "import time; time.sleep(60)"
        return [sys.executable, "-c", code]

    res = run_workers(None, argv, timeout=30, fail_fast_grace=0.2)
    assert res[0].returncode == 3
    assert res[1].returncode != 0  # killed, not left hanging


# ---------------------------------------------------------------------------
# the emulated link itself (root + iproute2)
# ---------------------------------------------------------------------------


@needs_netns
def test_emulated_link_shapes_all_reduce() -> None:
    # 20 Mbit/s: far below what loopback reaches even on a loaded machine (~280 Mbit/s with both
    # cores busy), so the last check tells "the shaper limits" from "the CPU limits" at any load.
    rate = parse_bandwidth("20mbit")
    assert rate is not None
    nbytes = 2_500_000  # ~1 s at 20 Mbit/s
    with EmulatedLink(rate) as link:
        assert sorted(link.namespaces) == sorted(_our_namespaces())
        for i, (ns, ifname) in enumerate(zip(link.namespaces, link.interfaces)):
            qdisc = subprocess.run(
                ["tc", "-n", ns, "qdisc", "show", "dev", ifname],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in qdisc  # both directions are shaped
            assert link.env(i)["GLOO_SOCKET_IFNAME"] == ifname
            assert link.command(i, ["true"]) == ["ip", "netns", "exec", ns, "true"]
        shaped = run_probe(link, nbytes=nbytes)
    assert _our_namespaces() == []
    loop = run_probe(None, nbytes=nbytes)

    assert shaped.correct and loop.correct
    assert shaped.latency_s > 0 and loop.latency_s > 0  # the round trip is probed too
    assert 0.3 * rate < shaped.bus_bps < 1.5 * rate, format_bps(shaped.bus_bps)
    assert loop.bus_bps > 3 * shaped.bus_bps, (format_bps(loop.bus_bps), format_bps(shaped.bus_bps))


@needs_netns
def test_failing_worker_still_cleans_up() -> None:
    def argv(rank: int) -> list[str]:
        code = "import sys; sys.exit(3)" if rank == 0 else "import time; time.sleep(60)"
        return [sys.executable, "-c", code]

    link = EmulatedLink(parse_bandwidth("100mbit") or 0)
    with pytest.raises(RuntimeError, match="worker failed"), link:
        res = run_workers(link, argv, timeout=30, fail_fast_grace=0.2)
        assert res[0].returncode == 3 and res[1].returncode != 0
        raise RuntimeError("worker failed")
    assert link.closed
    assert _our_namespaces() == []
    link.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        run_workers(link, argv)


@needs_netns
def test_cleanup_stale_removes_orphans_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"pf-{dead.pid}-abcdef-0"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        with EmulatedLink(10 * MBIT) as link:
            removed = cleanup_stale()
            # removed by this call, or by a bench's own clean-up at its start in a test beside
            # this one (pytest-xdist): either way gone, and only it
            assert not _named(orphan)
            assert not set(link.namespaces) & set(removed)  # our live link is untouched
            assert sorted(_our_namespaces()) == sorted(link.namespaces)
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)
    assert _our_namespaces() == []


def test_only_two_endpoints() -> None:
    with pytest.raises(ValueError, match="2 endpoints"):
        EmulatedLink(10 * MBIT, n_endpoints=3)


@needs_netns
def test_delay_needs_netem_and_never_leaks() -> None:
    from pufferfish.bench.netns import netem_available

    reason = netem_available()
    link = EmulatedLink(100 * MBIT, delay_ms=5)
    if reason is not None:  # e.g. minimal VM kernels: a clear error, nothing left behind
        with pytest.raises(RuntimeError, match="netem"), link:
            pass
    else:
        with link:
            qdisc = subprocess.run(
                ["tc", "-n", link.namespaces[0], "qdisc", "show", "dev", link.interfaces[0]],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "netem" in qdisc and "tbf" in qdisc
            probed = run_probe(link, nbytes=100_000)
        # A one-float all-reduce of 2 ranks is a round trip: at least 2 x 5 ms (a lower bound
        # that load cannot break; the shaper adds, never removes, delay).
        assert probed.correct and probed.latency_s >= 0.010
        assert probed.alpha_s == probed.latency_s / 2
    assert _our_namespaces() == []
