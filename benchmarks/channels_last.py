"""One training step's compute in NCHW and channels-last (NHWC), full rank and Pufferfish.

    .venv/bin/python benchmarks/channels_last.py [--rounds 30] [--width 0.25] [--batch-size 64]

One process, one thread: forward + backward of one Fashion-MNIST-shaped batch through ResNet-18,
dense and factorized by the paper's preset, in both memory formats, the four interleaved round by
round so that a noisy moment hits them alike; prints the median milliseconds of each. Results:
docs/benchmarks.md, "Channels-last convolutions".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pufferfish import factorize
from pufferfish.models import build_at_width


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))
    models = {}
    for low in (False, True):
        for channels_last in (False, True):
            model = build_at_width("resnet18", args.width, num_classes=10, in_channels=1,
                                   image_size=28)
            if low:
                factorize(model, rank_ratio=0.25, preset="paper")
            if channels_last:
                model.to(memory_format=torch.channels_last)
            models[("pufferfish" if low else "full rank", "NHWC" if channels_last else "NCHW")] = model

    def step(model: torch.nn.Module) -> float:
        t0 = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return time.perf_counter() - t0

    for model in models.values():  # warm-up
        step(model), step(model)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for key, model in models.items():
            times[key].append(step(model))
    for (name, layout), ts in times.items():
        print(f"{name:10s} {layout}: {1000 * statistics.median(ts):6.1f} ms")


if __name__ == "__main__":
    main()
