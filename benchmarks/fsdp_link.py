"""DDP against FSDP2, full rank against Pufferfish, over an emulated link: ``pufferfish train``.

    python benchmarks/fsdp_link.py OUT_DIR BANDWIDTH [pufferfish train flags...]

Runs ``pufferfish train`` with 2 processes, each in its own network namespace joined by a veth
pair limited to BANDWIDTH (``100mbit``; ``loopback`` for none), via the bench's
:class:`~pufferfish.bench.netns.EmulatedLink` (root, ``ip``, ``tc``). The four runs
(``--parallel ddp|fsdp`` x ``--mode full|pufferfish``) go one after the other in one link; each
writes its run directory under OUT_DIR. Prints one line per run: the median epoch time after the
switch epoch, bytes per step, and the final test metric.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from pufferfish.bench.bandwidth import parse_bandwidth
from pufferfish.bench.netns import EmulatedLink
from pufferfish.bench.workers import run_workers


def main(out: Path, bandwidth: str, flags: list[str]) -> None:
    rate = None if bandwidth == "loopback" else parse_bandwidth(bandwidth)
    link = EmulatedLink(rate) if rate else None
    with link if link is not None else _Nothing():
        for parallel in ("ddp", "fsdp"):
            for mode in ("full", "pufferfish"):
                run = out / f"{bandwidth}-{parallel}-{mode}"
                argv = [sys.executable, "-m", "pufferfish", "train", *flags, "--mode", mode,
                        "--parallel", parallel, "--out", str(run), "--overwrite",
                        "--no-progress", "--checkpoint-every-epochs", "0"]
                results = run_workers(link, lambda rank, argv=argv: argv, timeout=3600,
                                      env={"OMP_NUM_THREADS": "1"})
                if any(r.returncode for r in results):
                    raise SystemExit(f"{parallel} {mode} failed:\n{results[0].stderr[-2000:]}")
                rows = [json.loads(line) for line in
                        (run / "metrics.jsonl").read_text().splitlines()]
                times = [r["epoch_time"] for r in rows[1:]] or [rows[0]["epoch_time"]]
                last = rows[-1]
                print(json.dumps({"link": bandwidth, "parallel": parallel, "mode": mode,
                                  "epoch_time_median": statistics.median(times),
                                  "epoch_times": [r["epoch_time"] for r in rows],
                                  "comm_bytes_per_step": last["comm_bytes_per_step"],
                                  "ring_bytes_per_step": last.get("ring_bytes_per_step"),
                                  "test_acc": last.get("test_acc"),
                                  "test_loss": last.get("test_loss")}), flush=True)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
