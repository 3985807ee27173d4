"""Forward + backward time of one LSTM layer stack: dense vs LowRankLSTM's two kernels.

    .venv/bin/python benchmarks/lstm_kernels.py [--hidden 150 1500] [--ratio 0.25] [--threads 2]

For each hidden size: ``nn.LSTM`` (dense), ``LowRankLSTM(fused=True)`` (nn.LSTM's fused kernel
on the merged factors) and ``LowRankLSTM(fused=False)`` (a Python loop over time steps on the
factors), at the language model's shapes (2 layers, input = hidden, bptt 35, batch 20). The
three are timed interleaved, median of ``--repeats`` rounds, so that drift on a shared machine
hits all of them; the table reports milliseconds and ratios to dense (>1: slower), and the MACs
each executes per forward pass (the fused kernel: the dense recurrence plus the merges).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pufferfish.lowrank import LowRankLSTM
from pufferfish.lowrank.counting import count_macs
from pufferfish.lowrank.report import format_table
from pufferfish.lowrank.svd import rank_from_ratio


def step_ms(layer: nn.Module, x: torch.Tensor, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        layer.zero_grad(set_to_none=True)
        out, (h, c) = layer(x)
        (out.sum() + h.sum() + c.sum()).backward()
    return (time.perf_counter() - start) / number * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[150, 650, 1500])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [("hidden", "rank", "dense ms", "fused ms", "loop ms", "fused/dense", "loop/dense",
             "MACs dense", "MACs loop", "MACs fused")]
    for h in args.hidden:
        dense = nn.LSTM(h, h, num_layers=2)
        r = rank_from_ratio(h, args.ratio)
        fused = LowRankLSTM.from_dense(dense, r, fused=True)
        loop = LowRankLSTM.from_dense(dense, r, fused=False)
        x = torch.randn(args.bptt, args.batch, h)
        layers = {"dense": dense, "fused": fused, "loop": loop}
        single = max(step_ms(m, x, 1) for m in layers.values())  # also a warm-up step
        number = max(1, int(300 / single))  # about 0.3 s per layer per round
        times: dict[str, list[float]] = {k: [] for k in layers}
        for _ in range(args.repeats):
            for name, layer in layers.items():
                times[name].append(step_ms(layer, x, number))
        ms = {k: statistics.median(v) for k, v in times.items()}
        # count_macs counts the factorized arithmetic (the loop's); the fused kernel executes the
        # dense recurrence plus one merge u @ v per matrix (2 layers x 2 matrices, 4h x r x h).
        macs = {"dense": count_macs(dense, x), "loop": count_macs(loop, x)}
        macs["fused"] = macs["dense"] + 2 * 2 * 4 * h * r * h
        rows.append((str(h), str(r), f"{ms['dense']:.2f}", f"{ms['fused']:.2f}",
                     f"{ms['loop']:.2f}", f"{ms['fused'] / ms['dense']:.2f}",
                     f"{ms['loop'] / ms['dense']:.2f}", f"{macs['dense'] / 1e6:.1f}M",
                     f"{macs['loop'] / 1e6:.1f}M", f"{macs['fused'] / 1e6:.1f}M"))
        print(" | ".join(rows[-1]), flush=True)  # progress: large sizes take a while
    print("\n".join(format_table(rows)))


if __name__ == "__main__":
    main()
