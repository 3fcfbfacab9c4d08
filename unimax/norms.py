"""RMSNorms of the GDN models: the decoder's (scaled by offset + w) and the mixer's gated one,
and the MLP's SwiGLU.

Each is a handful of fp32 elementwise kernels in eager mode; over a long prompt (16k tokens of a
0.8B model) they stream gigabytes of fp32 intermediates. For prompts (more than ``LONG`` tokens,
CUDA, fla installed) fla's fused Triton kernels compute the same formulas in one pass each (the ones
transformers' Qwen3.5 uses): the kernel configuration's ``fla_prompt_kernels``, on since the prefill
runs in one chunk of 16k and short prompts in captured graphs, where their Python no longer costs:
on the H200 (0.8B hybrid shape, bench/RESULTS.md) they cut 16k tokens 100.0 -> 94.0 ms, 4096 32.3 ->
23.9, 1000 10.3 -> 8.3, 512 7.5 -> 6.1, 128 on a kept 4096 8.7 -> 7.3, with the same error against
transformers in FP32 as the torch forms (they match those on the H200: tests/gpu/test_gpu.py).
(Earlier, with 8k chunks and eager short prompts, they gave nothing at 512 and were slower at 16k.)
bench/ttft.py --variants torch-norms and bench/profile_prefill.py --torch-norms time the torch forms
beside them. Decode steps and verify blocks (<= LONG tokens) keep the torch forms, which inductor
fuses in the compiled step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .ops.conv import LONG  # more tokens than this: a prompt


@functools.cache
def fla_norm_ops():
    """fla's (rms_norm, rms_norm_gated, swiglu), or None (imported lazily, CUDA work only)."""
    try:
        from fla.modules.activations import swiglu
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except Exception:  # ImportError, or Triton failing to initialise on this machine
        return None
    return rms_norm, rms_norm_gated, swiglu


def prompt_kernels(x: torch.Tensor, tokens: int):
    """fla's ops for a prompt of ``tokens`` on x's device, or None (the torch forms)."""
    if not kernels.active().fla_prompt_kernels or not x.is_cuda or tokens <= LONG:
        return None
    return fla_norm_ops()


class RMSNorm(nn.Module):
    """RMSNorm in fp32, scaled by (offset + w): offset 0 for fla, 1 for Qwen3.5's zero-centred."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, ..., D): a block's (B, T, D), or attention's per head (B, T, H, D)."""
        fla = prompt_kernels(x, x.shape[1] if x.dim() >= 3 else 1)
        if fla is not None:
            return fla[0](x, self.offset + self.weight.float(), None, eps=self.eps)
        return rms_norm_ref(x, self.weight, self.eps, self.offset)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the mixer output, scaled by w and gated by act(z)."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.activation_name = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate (B, T, H, D)."""
        fla = prompt_kernels(x, x.shape[1])
        if fla is not None:
            return fla[1](x, gate, self.weight, None, activation=self.activation_name,
                          eps=self.eps)
        return gated_rms_norm_ref(x, gate, self.weight, self.eps, self.activation_name)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> torch.Tensor:
    """The torch form of RMSNorm over the last dim (also the twin of the draft's fused GEMV
    prologue, unimax.ops.fused_gemv)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.float())).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str) -> torch.Tensor:
    """The torch form of the gated RMSNorm over the last dim (per head), gated by
    activation(gate): "silu" or "sigmoid"."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    act = F.silu if activation == "silu" else torch.sigmoid
    return (y * act(gate.float())).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate, up (B, T, I)."""
    fla = prompt_kernels(gate, gate.shape[1])
    if fla is not None:
        return fla[2](gate, up)
    return F.silu(gate) * up
