"""The headline plots: accuracy against modelled wall-clock (time to accuracy, each baseline at its best)
and DiLoCo's validation perplexity against seconds."""

from __future__ import annotations

from pathlib import Path

from claims import LINK_NAMES
from pufferfish.bench import accuracy as acc


def plot_tta(curves_by_seed: dict[int, list[acc.Curve]], links: list[str], title: str,
             png: Path) -> None:
    """Test accuracy against modelled wall-clock, one panel per link, a line style per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.2), squeeze=False)
    colors = {}
    for ax, link in zip(axes[0], links):
        for seed, curves in curves_by_seed.items():
            for c in (c for c in curves if c.regime == link):
                color = colors.setdefault(c.method, f"C{len(colors)}")
                ax.plot([t / 3600 for t in c.times], [100 * a for a in c.accuracies],
                        ("-" if seed == min(curves_by_seed) else "--"), color=color,
                        label=f"{c.method} s{seed}")
        ax.set_title(LINK_NAMES.get(link, link), fontsize=9)
        ax.set_xlabel("hours (steps x measured step time)", fontsize=8)
        lows = [100 * a for cs in curves_by_seed.values() for c in cs for a in c.accuracies[-4:]]
        ax.set_ylim(min(lows) - 1, max(lows) + 0.5)
    axes[0][0].set_ylabel("test accuracy (%)", fontsize=8)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def plot_diloco(data: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
    colors: dict[str, str] = {}
    for ax, seed in zip(axes, sorted(data["targets"])):
        for (label, s), curve in data["curves"].items():
            if s != seed:
                continue
            color = colors.setdefault(label, f"C{len(colors)}")
            ax.plot([t for t, _ in curve], [p for _, p in curve], color=color, label=label)
        ax.axhline(data["targets"][seed], color="k", lw=0.8, ls=":", label="DDP final + 5%")
        ax.set_yscale("log")
        ax.set_ylim(50, 400)
        ax.set_title(f"seed {seed}, 100 Mbit/s (modelled)", fontsize=9)
        ax.set_xlabel("seconds", fontsize=8)
    axes[0].set_ylabel("validation perplexity", fontsize=8)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
