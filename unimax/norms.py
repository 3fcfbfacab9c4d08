"""RMSNorms of the GDN models: the decoder's (scaled by offset + w) and the mixer's gated one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm in fp32, scaled by (offset + w): offset 0 for fla, 1 for Qwen3.5's zero-centred."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the mixer output, scaled by w and gated by act(z)."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.activation = F.silu if activation == "silu" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * self.activation(gate.float())).to(x.dtype)
