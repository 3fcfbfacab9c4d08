"""Depthwise causal convolution with a rolling state: ``(x, weight, state) -> (y, new_state)``.

x (B, T, D); weight (D, W); state (B, D, W) holds the last W inputs (zeros for a fresh sequence),
the same layout as transformers' linear-attention cache and fla's ShortConvolution cache.
Output is SiLU(conv), as both the fla and the Qwen3.5 GDN layers use.

Three forms: ``causal_conv1d_step`` (one token), ``causal_conv1d`` (a few tokens: the verifier's
block, bit-for-bit the steps' arithmetic) and ``causal_conv1d_long`` (prompts). The block form
materialises every window in fp32, (B, D, T, W): at a 16k-token prefill of a 0.8B model that was
a 2.6 ms reduction plus a 0.9 ms concatenation per GDN layer on the H200. The long form runs
fla's Triton kernel on CUDA (SiLU fused, reading x in place) or a depthwise fp32 ``conv1d``
elsewhere; it rounds like any fp32 convolution, not necessarily like the steps.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

LONG = 64  # more tokens than this take causal_conv1d_long (the verifier's blocks stay below)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """Any number of new tokens: prepend the state, convolve without padding, keep the tail.

    Computed as ``causal_conv1d_step`` computes it (fp32 products of each window, summed over
    W), so a block of T tokens gives bit-for-bit the outputs of T of those steps. (On CUDA the
    decoder's steps run fla's conv-update kernel instead, unimax.ops.decode_step, whose SiLU
    rounds its own way: there a conv output may sit one BF16 rounding apart from this form's,
    as the matmuls of a block and of a step may.)"""
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


@functools.cache
def fla_conv():
    """fla's causal conv, or None (imported lazily, CUDA work only, like ops.gated_delta)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as conv
    except Exception:  # ImportError, or Triton failing to initialise on this machine
        return None
    return conv


def causal_conv1d_long(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       backend: str = "auto"):
    """Many new tokens (a prompt): the same contract as ``causal_conv1d``. ``backend``: "fla"
    (CUDA), "torch" (a depthwise fp32 conv1d), or "auto" (fla where it runs)."""
    if backend == "auto":
        backend = "fla" if x.is_cuda and fla_conv() is not None else "torch"
    width = weight.shape[-1]
    if backend == "fla":
        y, new_state = fla_conv()(x, weight=weight, initial_state=state.to(x.dtype),
                                  output_final_state=True, activation="silu")
        return y, new_state
    if backend != "torch":
        raise ValueError(f"unknown conv backend {backend!r}; use 'auto', 'fla' or 'torch'")
    # The state's last W - 1 inputs precede x (its oldest entry has left every window).
    full = torch.cat([state[..., 1:].to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, D, W-1+T)
    y = F.conv1d(full.float(), weight.float()[:, None, :], groups=weight.shape[0])
    return F.silu(y).to(x.dtype).transpose(1, 2), full[..., -width:]  # (T >= 1: W entries)


def conv_window_after(state: torch.Tensor, inputs: torch.Tensor, valid: torch.Tensor
                      ) -> torch.Tensor:
    """The conv state (B, D, W) after the first ``valid`` (a 0-d device tensor) of ``inputs``
    (B, T, D) fed on ``state`` (B, D, W): entries valid .. valid + W - 1 of [the W before, the
    T new]. For forwards whose real length is on the device (a padded prompt, a verify block's
    accepted prefix).

    Gathered from each side, never concatenated: [state, inputs] of a 4096-token padded
    prompt is ~50 MB per layer at 0.8B, and its copy was 15% of that prompt's prefill on the
    H200 (bench/RESULTS.md); the window is W entries."""
    width = state.shape[-1]
    where = valid + torch.arange(width, device=state.device)  # in [state, inputs]
    from_state = state.to(inputs.dtype).index_select(-1, where.clamp(max=width - 1))
    from_inputs = inputs.index_select(1, (where - width).clamp(0, inputs.shape[1] - 1))
    return torch.where(where < width, from_state, from_inputs.transpose(1, 2))

