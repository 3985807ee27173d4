"""Step times of full-rank and factorized models on one accelerator: the GPU's own compute ratio.

The CPU's factorized/full step ratio is not a GPU's: a factorized layer is two smaller GEMMs (or
convolutions), which a GPU at small batch may run no faster than one large one (launch-bound).
This measures, for ResNet-18 and VGG-19-BN at the paper's width (CIFAR-10 shapes) and llama at
width 1.0 (GaLore's LLaMA-60M shape), the full-rank model and the paper preset's factorization at
rank ¼: a training step (forward, backward, optimizer) at each batch size, eager and
``torch.compile(mode="reduce-overhead")`` (CUDA graphs), in fp16 and bf16 autocast. Each timing is
the median of ``--steps`` steps after ``--warmup`` (CUDA events; wall clock on a CPU).

    python benchmarks/gpu_suite.py --out OUT [--deadline-s 480] [--models resnet18,vgg19_bn,llama]

Results go to ``OUT/steps.jsonl`` (one line per setting, written as measured, so a deadline or a
crash keeps what was done) and ``OUT/summary.md`` (factorized / full per setting). The settings
run in priority order (eager fp16 at every batch first, then bf16, then the compiled ones), and a
setting that would start after the deadline is skipped and named in the summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pufferfish as pf
from pufferfish.models import build_at_width

LLAMA_SEQ = 256  # tokens per sequence; llama's "batch" is sequences


def build(name: str, width: float, factorized: bool, device: torch.device) -> torch.nn.Module:
    if name == "llama":
        model = build_at_width("llama", width, vocab_size=4096, max_len=LLAMA_SEQ)
    else:
        model = build_at_width(name, width)
    if factorized:
        pf.factorize(model, preset="paper")
    return model.to(device)


def batch_for(name: str, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "llama":
        x = torch.randint(0, 4096, (batch, LLAMA_SEQ), device=device)
        return x, torch.roll(x, -1, dims=1)
    return torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,),
                                                                       device=device)


def time_steps(name: str, model: torch.nn.Module, batch: int, dtype: torch.dtype, compiled: bool,
               steps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each timed training step."""
    model.train()
    if name == "llama":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    forward = torch.compile(model, mode="reduce-overhead") if compiled else model
    x, y = batch_for(name, batch, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16
                                  and device.type == "cuda")

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            out = forward(x)
            loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - t0))
    return times


def settings(models: list[str], batches: list[int], dtypes: list[str],
             compiles: list[bool]) -> list[dict[str, Any]]:
    """Every setting in priority order: eager before compiled, the first dtype first."""
    out = []
    for compiled in compiles:
        for dtype in dtypes:
            for name in models:
                for batch in (batches if name != "llama" else [max(1, b // 16) for b in batches]):
                    out.append({"model": name, "batch": batch, "dtype": dtype,
                                "compiled": compiled})
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = out / "steps.jsonl"
    done: list[dict[str, Any]] = []
    started = time.monotonic()
    for s in settings(args.models.split(","), [int(b) for b in args.batches.split(",")],
                      args.dtypes.split(","), [c == "compile" for c in args.modes.split(",")]):
        if time.monotonic() - started > args.deadline_s:
            done.append({**s, "skipped": "deadline"})
            continue
        row = dict(s)
        for factorized in (False, True):
            key = "factorized" if factorized else "full"
            try:
                torch.manual_seed(0)
                model = build(s["model"], args.width if s["model"] != "llama" else 1.0,
                              factorized, device)
                times = time_steps(s["model"], model, s["batch"], getattr(torch, s["dtype"]),
                                   s["compiled"], args.steps, args.warmup, device)
                row[f"{key}_ms"] = statistics.median(times)
                row[f"{key}_params"] = sum(p.numel() for p in model.parameters())
            except Exception as e:  # an OOM or a compile failure is a result too
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
        if "full_ms" in row and "factorized_ms" in row:
            row["factorized_over_full"] = row["factorized_ms"] / row["full_ms"]
        with lines.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        done.append(row)
    (out / "summary.md").write_text(summary(done, device))
    return done


def summary(rows: list[dict[str, Any]], device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = [f"# benchmarks/gpu_suite.py on {name} (torch {torch.__version__})", "",
            "| model | batch | dtype | mode | full ms | factorized ms | factorized / full |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = "compile (CUDA graphs)" if r["compiled"] else "eager"
        if "skipped" in r:
            text.append(f"| {r['model']} | {r['batch']} | {r['dtype']} | {mode} | skipped: "
                        f"{r['skipped']} | | |")
            continue
        full = f"{r['full_ms']:.2f}" if "full_ms" in r else r.get("full_error", "-")
        fact = f"{r['factorized_ms']:.2f}" if "factorized_ms" in r else r.get(
            "factorized_error", "-")
        ratio = f"{r['factorized_over_full']:.2f}" if "factorized_over_full" in r else "-"
        text.append(f"| {r['model']} | {r['batch']} | {r['dtype']} | {mode} | {full} | {fact} "
                    f"| {ratio} |")
    return "\n".join(text) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="resnet18,vgg19_bn,llama")
    ap.add_argument("--batches", default="128,256,512,1024")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--width", type=float, default=1.0, help="image models' width")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=480.0)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
