"""What ``--amp`` runs in on this device, and its refusal where this CPU has no such kernel.

``--amp`` is fp16 autocast (and a GradScaler, build.py) on CUDA, bf16 autocast on CPU. On a CPU
without bf16 kernels (AVX2 only, as an AMD EPYC; or ``ONEDNN_MAX_CPU_ISA=AVX2``) torch falls back
to its own kernels for a bf16 convolution or matmul, but not for the recurrent layers: oneDNN
refuses the bf16 LSTM at its first forward ("could not create a primitive descriptor for the LSTM
forward propagation primitive"), a traceback mid-run. So a run whose model has a recurrent layer
tries that layer's kernel once, on a tiny instance (cached per process: what the CPU can do, not
what its flags say), and refuses ``--amp`` in one line before anything is written, on every rank
when any rank's CPU refuses.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..config import ConfigError, TrainConfig
from ..distributed import env as dist_env
from ..distributed.env import DistEnv
from ..models import build_at_width

__all__ = ["amp_dtype", "autocast", "bf16_refused", "check_amp", "recurrent_kinds"]

_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)  # the layers whose bf16 kernel has no torch fallback


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The forward pass's autocast dtype on ``device``: None without ``--amp``, fp16 on CUDA,
    bf16 on CPU."""
    if not cfg.amp:
        return None
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def autocast(cfg: TrainConfig, env: DistEnv) -> contextlib.AbstractContextManager:
    """The forward pass's autocast (:func:`amp_dtype`), a null context without ``--amp``."""
    dtype = amp_dtype(cfg, env.device)
    return contextlib.nullcontext() if dtype is None else torch.autocast(env.device.type,
                                                                          dtype=dtype)


@functools.cache
def bf16_refused(kind: type[nn.RNNBase]) -> str | None:
    """Why this CPU cannot run ``kind`` (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) under bf16
    autocast: the error's first sentence from one forward and backward of a 4-wide instance, or
    None where it runs. The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        layer = kind(4, 4)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(torch.randn(3, 2, 4))[0]
            out.float().sum().backward()
        except RuntimeError as e:
            return str(e).split(". ")[0].splitlines()[0] if str(e) else type(e).__name__
    return None


def recurrent_kinds(cfg: TrainConfig) -> list[type[nn.RNNBase]]:
    """The recurrent layer classes of ``cfg.model`` at ``cfg.width``, from a skeleton on the meta
    device (no memory, no RNG, no data: before the run directory is touched)."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = build_at_width(cfg.model, cfg.width, vocab_size=8)
    return [kind for kind in _RECURRENT if any(isinstance(m, kind) for m in model.modules())]


def check_amp(cfg: TrainConfig, env: DistEnv) -> None:
    """Refuse ``--amp`` on a CPU that cannot run the model's recurrent layers in bf16 (see the
    module docs), naming the flag and what is allowed; on every rank if any rank refuses."""
    if not cfg.amp or env.device.type != "cpu":
        return
    reason = next((f"its {kind.__name__} has no bf16 kernel on this CPU ({why})"
                   for kind in recurrent_kinds(cfg) if (why := bf16_refused(kind))), None)
    reasons = dist_env.gather_object(reason, env)
    rank, why = next(((r, w) for r, w in enumerate(reasons) if w), (None, None))
    if why is not None:
        where = f" on rank {rank}" if env.distributed else ""
        raise ConfigError(f"--amp (bf16 autocast on CPU) is invalid for model {cfg.model!r}"
                          f"{where}: {why}; allowed: --no-amp (fp32), or a CUDA device")
