"""The int4 draft's weight format (unimax.int4): 4-bit values in -7..7 with a scale per group of
columns, two values a byte. Pure functions, below the kernels that read the format
(ops.int4_gemv) and the module that stores it (unimax.int4)."""

from __future__ import annotations

import torch


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> q (N, K) int8 in -7..7 and a scale (N, K / group) in weight's dtype, absmax /
    7 per group (draft_bits.round_weight's rounding for 4 bits): the weight is q * scale."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4: K {k} is not a multiple of the group {group}")
    w = weight.float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7
    q = torch.round(w / scale).clamp(-7, 7).to(torch.int8).reshape(n, k)
    return q, scale.reshape(n, -1).to(weight.dtype)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (N, K), scale (N, K / group) -> the fp32 weight."""
    n, k = q.shape
    group = k // scale.shape[1]
    return (q.float().reshape(n, -1, group) * scale.float()[..., None]).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in -7..7 -> (N, K / 2) uint8: q + 8 of column 2j in byte j's low nibble, of
    2j + 1 in its high one."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: (N, K / 2) uint8 -> q (N, K) int8."""
    q = torch.stack(((packed & 15).to(torch.int8), (packed >> 4).to(torch.int8)), dim=-1)
    return (q - 8).reshape(packed.shape[0], -1)


def quantize_packed(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored form: (packed (N, K / 2) uint8, scale (N, K / group) float16)."""
    q, scale = quantize_int4(weight, group)
    return pack_nibbles(q), scale.to(torch.float16)


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(unpack_nibbles(packed), scale)
