"""Bit packing for 1-bit payloads (``signum``): bool tensors to uint8 bytes and back."""

import torch

__all__ = ["pack_bits", "unpack_bits"]

# Most-significant bit first, like ``numpy.packbits(bitorder="big")``.
_BIT_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (flattened) into ``ceil(numel / 8)`` uint8 bytes, MSB first.

    Same layout as ``numpy.packbits``; the last byte is zero-padded.
    """
    flat = bits.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # Each row holds 8 distinct powers of two, so the uint8 sum cannot overflow.
    return (flat.view(-1, 8) << _shifts(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` along the last dim: ``(..., nbytes)`` -> bool ``(..., numel)``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if numel > 8 * packed.shape[-1]:
        raise ValueError(f"cannot unpack {numel} bits from {packed.shape[-1]} bytes")
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :numel].bool()
