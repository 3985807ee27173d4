"""The bench's plots: measured step time per link (``step_time.png``) and the projected step time
against bandwidth for each worker count (``projection.png``). matplotlib is imported when
plotting, so that the rest of the bench does not need it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import projection as proj
from .bandwidth import TORCHRUN_LINK, parse_link

__all__ = ["plot_results"]


def plot_results(result: dict[str, Any], out: Path) -> list[Path]:
    """Write ``step_time.png`` and ``projection.png`` into ``out``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["rows"]
    # Fastest link on the left: loopback, then emulated rates in decreasing order (the same rate
    # without delay before with).
    def speed(b: str) -> tuple[float, float]:
        rate, delay = (None, 0.0) if b == TORCHRUN_LINK else parse_link(b)
        return -(rate or float("inf")), delay

    order = sorted(dict.fromkeys(r["bandwidth"] for r in recs), key=speed)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in recs):
        pts = sorted((order.index(r["bandwidth"]), r["step_time"], *r["spread"]["step_time"])
                     for r in recs if r["method"] == m)
        ax.errorbar([x for x, *_ in pts], [y for _, y, _, _ in pts],
                    yerr=[[y - lo for _, y, lo, _ in pts], [hi - y for _, y, _, hi in pts]],
                    marker="o", capsize=3, label=m)
    ax.set_xticks(range(len(order)), order)
    ax.set(xlabel="link", ylabel="step time (s): median, bars min–max over rounds",
           yscale="log", title=f"measured step time, {recs[0]['workers']} workers, "
                               f"{max(r['rounds'] for r in recs)} rounds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "step_time.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    projection = result["projection"]
    profiles = [proj.CommProfile(**p) for p in projection["profiles"]]
    workers = projection["workers"]
    fig, axes = plt.subplots(1, len(workers), figsize=(5 * len(workers), 4), sharey=True)
    grid = [10 ** (7 + k / 10) for k in range(41)]  # 10 Mbit/s .. 100 Gbit/s
    for ax, p in zip(axes, workers):
        for prof in profiles:
            ax.plot([b / 1e9 for b in grid],
                    [proj.step_time(prof, p, b, projection["alpha"]) for b in grid],
                    label=prof.method)
        ax.set(xscale="log", yscale="log", xlabel="bandwidth (Gbit/s)", title=f"p = {p}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("projected step time (s)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "projection.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
