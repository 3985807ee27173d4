"""What the switch's SVD sees: each factorized layer's spectrum at initialization and in a checkpoint.

For a full-rank run's checkpoint, the layers the paper preset factorizes (at the run's rank
ratio, ¼ by default) are compared between a fresh initialization of the same model and the
checkpoint's weights: the spread of the kept singular values (σ₁/σᵣ), the smallest and mean √σ
among them (the scale of each direction in the balanced factors U√Σ and √ΣVᵀ), the share of the
squared Frobenius norm the rank keeps, and the weights' root-mean-square entry. The question it
answers: do the factors Pufferfish takes from trained weights differ in scale or spread from the
factors low rank from the start takes from its random initialization?

    python benchmarks/factor_spectrum.py runs/llama-full/checkpoints/ckpt-000000455.pt

``--ranks CKPT...`` answers the question after training: how evenly each checkpoint's layers use
the rank they have. Per layer kind (the last part of the name: ``q_proj``, ``up_proj``, ...) the
mean over layers of the effective rank (the exponential of the entropy of the normalized top-r
singular values; r at most the rank ratio's) and of the stable rank (Σσ² / σ₁²) of each weight:
a factor pair's product ``u @ v`` (the linear layers' ``X.u.weight``, ``X.v.weight``), a dense
weight's top r. Both checkpoints of a low-rank run and of a full-rank one.

    python benchmarks/factor_spectrum.py --ranks runs/a/checkpoints/ckpt-000000681.pt runs/b/...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pufferfish import factorize
from pufferfish.models import build_at_width
from pufferfish.training.checkpoint import load_checkpoint


def spectrum(weight: torch.Tensor, rank: int) -> dict[str, float]:
    """Figures of ``weight``'s top-``rank`` singular values (float64)."""
    s = torch.linalg.svdvals(weight.detach().double().reshape(weight.shape[0], -1))
    kept = s[:rank]
    return {"spread": float(kept[0] / kept[-1]), "min_root": float(kept[-1].sqrt()),
            "mean_root": float(kept.sqrt().mean()), "energy": float(kept.square().sum() / s.square().sum()),
            "rms": float(weight.double().square().mean().sqrt())}


def rank_use(weights: dict[str, torch.Tensor], ratio: float) -> dict[str, tuple[float, float]]:
    """Per layer kind, the mean effective and stable rank of the top-r spectrum (module docs)."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for name, w in weights.items():
        if name.endswith(".u.weight") and f"{name[:-9]}.v.weight" in weights and w.dim() == 2:
            layer, weight = name[:-9], w.double() @ weights[f"{name[:-9]}.v.weight"].double()
        elif name.endswith("_proj.weight") and w.dim() == 2:  # a dense projection
            layer, weight = name[:-7], w.double()
        else:
            continue
        s = torch.linalg.svdvals(weight)[:max(1, round(ratio * min(weight.shape)))]
        p = s / s.sum()
        kinds.setdefault(layer.rsplit(".", 1)[-1], []).append(
            (float(torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())),
             float(s.square().sum() / s[0].square())))
    return {k: (sum(e for e, _ in v) / len(v), sum(r for _, r in v) / len(v))
            for k, v in kinds.items()}


def ranks_table(paths: list[Path]) -> int:
    rows = []
    for path in paths:
        if not path.is_file():
            print(f"factor_spectrum: --ranks {str(path)!r} is not a file: allowed ckpt-*.pt files",
                  file=sys.stderr)
            return 2
        state = load_checkpoint(path)
        ratio = state["config"].get("rank_ratio", 0.25)
        rows.append((path, rank_use(state["model"], 0.25 if ratio == "auto" else float(ratio))))
    kinds = sorted({k for _, use in rows for k in use})
    print("effective rank / stable rank of each layer kind's top-r spectrum, mean over layers\n")
    print("| checkpoint | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for path, use in rows:
        print(f"| {path} | " + " | ".join(f"{use[k][0]:.1f} / {use[k][1]:.1f}" if k in use
                                          else "–" for k in kinds) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", help="a full-rank run's checkpoint (ckpt-*.pt)")
    ap.add_argument("--ranks", nargs="+", type=Path, metavar="CKPT",
                    help="how evenly each checkpoint's layers use their rank (see above)")
    args = ap.parse_args(argv)
    if args.ranks:
        return ranks_table(args.ranks)
    if args.checkpoint is None:
        ap.error("give a checkpoint, or --ranks CKPT...")
    path = Path(args.checkpoint)
    if not path.is_file():
        print(f"factor_spectrum: checkpoint {str(path)!r} is not a file: allowed a ckpt-*.pt of a "
              "full-rank run", file=sys.stderr)
        return 2
    state = load_checkpoint(path)
    cfg, weights = state["config"], state["model"]
    torch.manual_seed(cfg.get("seed", 0))
    model = build_at_width(cfg["model"], cfg["width"], vocab_size=cfg.get("vocab_size"))
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    ratio = float(cfg.get("rank_ratio", 0.25)) if cfg.get("rank_ratio") != "auto" else 0.25
    report = factorize(model, rank_ratio=ratio, preset="paper")
    missing = [d.name for d in report.factorized if f"{d.name}.weight" not in weights]
    if missing:
        print(f"factor_spectrum: {str(path)!r} has no dense weight for {missing[0]!r}: allowed a "
              "checkpoint taken before the switch (or of a full-rank run)", file=sys.stderr)
        return 2
    step = state["progress"]["global_step"]
    print(f"{cfg['model']} width {cfg['width']}, rank ratio {ratio}: initialization -> step {step}\n")
    print("| layer | rank | σ₁/σᵣ | min √σ | mean √σ | energy kept | rms entry |")
    print("|---|---|---|---|---|---|---|")
    for d in report.factorized:
        a, b = spectrum(init[f"{d.name}.weight"], d.rank), spectrum(weights[f"{d.name}.weight"], d.rank)
        cells = [f"{a[k]:.2f} -> {b[k]:.2f}" for k in ("spread", "min_root", "mean_root", "energy")]
        print(f"| {d.name} | {d.rank} | " + " | ".join(cells) + f" | {a['rms']:.4f} -> {b['rms']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
