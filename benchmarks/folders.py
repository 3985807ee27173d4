"""The cache's folders: where each cached study lives under ``benchmarks/results/``, named once.

The report (``paper.py``, ``claims/``) and the drivers take the cache's root (``--cache``,
default :data:`CACHE`) and look a study up here by what it is; ``benchmarks/results/README.md``
says what each folder holds and how it was measured. A study cached again under a new folder
changes one line here.
"""

from __future__ import annotations

from pathlib import Path

CACHE = Path("benchmarks/results")  # from the repository root, where paper.sh runs

FOLDERS: dict[str, str] = {
    # ResNet-18 / VGG-19-BN at the paper's width, 20 epochs on one GPU (full, puff, lowrank, psgd)
    "converged-resnet18": "resnet18-w1-fashion-e20-gpu",
    "converged-vgg19": "vgg19-w1-fashion-e20-gpu",
    # the bench with automatic buckets that times the converged ResNet-18 runs
    "converged-bench": "buckets-2026-12-05/w1-auto-idle/results.json",
    # benchmarks/image_ranks.py: each baseline at its best (width 0.25, 20 epochs, 2 seeds)
    "image-ranks": "resnet18-w0.25-fashion-e20-ranks",
    # the newest `make demo` (benchmarks/demo.sh's 4 methods)
    "demo": "demo-picks-2026-12-08",
    # benchmarks/lm_budget.py's study (and lm_links.py's runs under links/)
    "lm-budget": "lm-budget",
    # `benchmarks/sweeps.py diloco` on llama ¼, one epoch: DiLoCo at H = 10 and 30, seeds 0 and 1
    "diloco-h10-s0": "diloco-llama-w0.25-kjv-e1",
    "diloco-h10-s1": "diloco-llama-w0.25-kjv-e1-s1",
    "diloco-h30-s0": "diloco-llama-w0.25-kjv-e1-h30",
    "diloco-h30-s1": "diloco-llama-w0.25-kjv-e1-h30-s1",
}


def folder(cache: Path, study: str) -> Path:
    """``cache``'s folder of ``study`` (a key of :data:`FOLDERS`)."""
    return cache / FOLDERS[study]
