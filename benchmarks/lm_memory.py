"""Memory per process of the LM methods: parameters, gradients and optimizer state, and the peak.

Each method runs in a fresh process (so its peak RSS is its own): the model at the given width
(Pufferfish and low rank: factorized with the paper preset at rank ¼, as after the switch),
the method's optimizer as `pufferfish train` builds it (AdamW with decay / no-decay groups,
GaLore's on the preset's layers), and a few steps on random tokens, one process, no DDP.

    python benchmarks/lm_memory.py --model llama --width 0.25 --seq-len 128 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F

METHODS = ("full", "pufferfish", "galore")


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _state_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _state_tensors(v)]
    return [t for v in getattr(obj, "__dict__", {}).values() for t in _state_tensors(v)]


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One method's figures, in this process."""
    from pufferfish.configfile import load_config
    from pufferfish.lowrank import factorize
    from pufferfish.models import build_at_width
    from pufferfish.training.methods import build_method

    torch.manual_seed(0)
    torch.set_num_threads(1)
    mode = args.method
    cfg = load_config(None, {"model": args.model, "data": "kjv", "mode": mode, "width": args.width,
                             "seq_len": args.seq_len, "vocab_size": args.vocab_size})
    model = build_at_width(args.model, args.width, vocab_size=args.vocab_size,
                           max_len=args.seq_len)
    if mode == "pufferfish":
        factorize(model, rank_ratio=0.25, preset="paper")
    method = build_method(cfg)
    tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1))
    method.setup(model, tokens[:, :-1], cfg)
    optimizer = method.build_optimizer(model, cfg)
    for _ in range(args.steps):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    params = list(model.parameters())
    return {
        "method": mode, "params": sum(p.numel() for p in params),
        "param_bytes": _bytes(params), "grad_bytes": _bytes([p.grad for p in params]),
        "optimizer_bytes": _bytes(_state_tensors(optimizer.state)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--method", choices=METHODS, help="measure one method here (internal)")
    args = ap.parse_args()
    if args.method:
        print(json.dumps(measure(args)))
        return
    print("| method | params | params MB | grads MB | optimizer MB | sum MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for method in METHODS:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--method", method],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        mb = [r[k] / 2**20 for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
        print(f"| {method} | {r['params']:,} | {mb[0]:.1f} | {mb[1]:.1f} | {mb[2]:.1f} | "
              f"{sum(mb):.1f} | {r['peak_rss_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
