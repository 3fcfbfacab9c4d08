"""Depthwise causal convolution with a rolling state: ``(x, weight, state) -> (y, new_state)``.

x (B, T, D); weight (D, W); state (B, D, W) holds the last W inputs (zeros for a fresh sequence),
the same layout as transformers' linear-attention cache and fla's ShortConvolution cache.
Output is SiLU(conv), as both the fla and the Qwen3.5 GDN layers use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """Any number of new tokens: prepend the state, convolve without padding, keep the tail."""
    seq_len, width = x.shape[1], weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, W + T)
    y = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])  # (B, D, T + 1)
    y = F.silu(y[..., -seq_len:]).transpose(1, 2)
    return y, full[..., -width:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One new token (T == 1) as a multiply-add over the window: no conv launch, graph-friendly."""
    window = torch.cat([state[..., 1:].to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, W)
    y = F.silu((window * weight).sum(-1, keepdim=True)).transpose(1, 2)
    return y, window
