"""Depthwise causal convolution with a rolling state: ``(x, weight, state) -> (y, new_state)``.

x (B, T, D); weight (D, W); state (B, D, W) holds the last W inputs (zeros for a fresh sequence),
the same layout as transformers' linear-attention cache and fla's ShortConvolution cache.
Output is SiLU(conv), as both the fla and the Qwen3.5 GDN layers use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """Any number of new tokens: prepend the state, convolve without padding, keep the tail.

    Computed as the step computes it (fp32 products of each window, summed over W), so a block
    of T tokens gives bit-for-bit the outputs of T single steps: the verifier and the decoder
    then disagree only where the matmuls round differently."""
    width = weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, W + T)
    windows = full[..., 1:].unfold(-1, width, 1)  # (B, D, T, W)
    y = (windows.float() * weight.float()[:, None, :]).sum(-1)  # (B, D, T)
    return F.silu(y).to(x.dtype).transpose(1, 2), full[..., -width:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One new token (T == 1): a multiply-add over the window, no conv launch."""
    window = torch.cat([state[..., 1:].to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, W)
    y = (window.float() * weight.float()).sum(-1, keepdim=True)
    return F.silu(y).to(x.dtype).transpose(1, 2), window
