"""A GDN mixer's in-projection with its short convolution folded in, for one-token decode steps
(unimax.fused_draft: the full-FP8 draft, BF16-only's fast step, the verifier's one-token
forwards): ``fused_in_proj_conv(x, weight, scale, ..., conv_state, conv_weight) -> projected``.

projected is RMSNorm(x) @ W^T (the fused GEMV's "rms" prologue) with its first C =
conv_weight.shape[0] channels, [q | k | v], replaced by SiLU(causal conv) of the new token, and
the conv state's windows rolled in place. Why: the convolution was a launch of its own per
layer (fla's causal_conv1d_update, ~1.7 us busy plus its gap on the H200: 32 per 4B step),
yet each of its channels is one output of the GEMV, computed whole by one program, which can
roll that channel's window itself without racing any other (ops/fused_gemv_kernels.py,
``conv_epilogue``). The recurrence then reads q, k and v from the projection
(ops.decode_step's ``conv_done``).

With ``beta_heads`` > 0 (the verifier's one-token forwards, whose mixers round beta =
sigmoid(b) to BF16 as the exact model does, where the draft and BF16-only take it unrounded
inside the recurrence's kernel) the b channels, beta_start .. beta_start + beta_heads - 1,
come out as beta itself (ops.decode_step.write_strength; the kernel's ``beta_epilogue``):
that was an inductor kernel of its own per layer, ~1 us busy plus its gap (32 in a 4B exact
step, 31.6 us busy: bench/RESULTS.md), the one kernel the verifier's
one-token step had that BF16-only's has not, so a run of k = 0 blocks (drafts too poor to
pay) cost 1.026 BF16 steps a token. With it the 4B one-token step went 2709 -> 2673 us
against BF16-only's 2652 (bench/profile_step.py's "exact" and "exact-nobeta", same run).

``fused_in_proj_conv_ref`` is the twin: the fused GEMV's twin, then ops.conv's one-token
convolution on the first C channels (and write_strength on the b channels).
"""

from __future__ import annotations

from typing import Optional

import torch

from .conv import causal_conv1d_step
from .decode_step import write_strength
from .fused_gemv import (
    CHOICES,
    CONV_TILE,
    candidates,
    check,
    check_conv,
    fused_gemv,
    fused_small_m_linear_ref,
    tma_offered,
)
from .gemv import tile_text, timed_choice

# the kernel where none was timed (a key first met in a capture): a named tile, never
# autotuned (the autotuner would rerun the kernel on the live state)
DEFAULT = f"rows@{tile_text(CONV_TILE)}"


def fused_in_proj_conv_ref(x, weight, scale, out_features: int, in_features: int,
                           norm_weight, eps: float, offset: float, conv_state,
                           conv_weight, beta_start: int = -1, beta_heads: int = 0,
                           beta_double: bool = False) -> torch.Tensor:
    """The twin: the projection (fused_small_m_linear_ref, "rms"), then the convolution of its
    first channels (ops.conv.causal_conv1d_step), the state written with copy_; then the b
    channels' write strength (ops.decode_step.write_strength), with beta_heads."""
    y = fused_small_m_linear_ref(x, weight, scale, out_features, in_features, "rms",
                                 norm_weight, None, None, eps, offset)
    return conv_and_beta_ref(y, conv_state, conv_weight, beta_start, beta_heads, beta_double)


def conv_and_beta_ref(y, conv_state, conv_weight, beta_start: int = -1, beta_heads: int = 0,
                      beta_double: bool = False) -> torch.Tensor:
    """The epilogue's twin on a projection y: its first C channels through the convolution,
    the state written with copy_, then the b channels' write strength with beta_heads (also
    ops.int4_fused's twin)."""
    channels = conv_weight.shape[0]
    conv, window = causal_conv1d_step(y[:, None, :channels], conv_weight,
                                      conv_state[:, :channels])
    conv_state[:, :channels].copy_(window)
    y = torch.cat([conv[:, 0], y[:, channels:]], dim=1)
    if beta_heads:
        end = beta_start + beta_heads
        y[:, beta_start:end] = write_strength(y[:, beta_start:end], beta_double)
    return y


def check_beta(out_features: int, channels: int, beta_start: int, beta_heads: int) -> None:
    """Names b channels that are not past the convolution's and inside the outputs."""
    if beta_heads and not (channels <= beta_start and beta_start + beta_heads <= out_features):
        raise ValueError(f"fused_in_proj_conv: the b channels {beta_start} .. "
                         f"{beta_start + beta_heads - 1} must lie past the {channels} "
                         f"convolved channels and inside the {out_features} outputs")


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::fused_in_proj_conv", mutates_args=("conv_state",))
def fused_in_proj_conv(x: torch.Tensor, weight: torch.Tensor,
                       scale: Optional[torch.Tensor],  # noqa: UP045
                       out_features: int, in_features: int, norm_weight: torch.Tensor,
                       eps: float, offset: float, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor, beta_start: int = -1, beta_heads: int = 0,
                       beta_double: bool = False) -> torch.Tensor:
    """RMSNorm(x) @ W^T (* scale), its first conv_weight.shape[0] channels through the causal
    convolution and SiLU, conv_state rolled in place (with ``beta_heads``: the b channels
    from beta_start through sigmoid, rounded, doubled with ``beta_double``): the fused kernel
    on CUDA, the twin elsewhere."""
    check_beta(out_features, conv_weight.shape[0], beta_start, beta_heads)
    if not x.is_cuda:  # (on CUDA fused_gemv checks the same, once per call)
        check(x, weight, out_features, in_features, "rms", norm_weight, None, None)
        check_conv(x, out_features, conv_state, conv_weight)
        return fused_in_proj_conv_ref(x, weight, scale, out_features, in_features,
                                      norm_weight, eps, offset, conv_state, conv_weight,
                                      beta_start, beta_heads, beta_double)
    # (one choice with and without beta: the epilogue's few channels do not move the time)
    key = ("rms+conv", False, x.shape[0], out_features, in_features, weight.dtype)
    beta = (beta_start, beta_heads, beta_double) if beta_heads else None

    def run(kernel: str, weight: torch.Tensor, scale: torch.Tensor | None,
            state: torch.Tensor = conv_state) -> torch.Tensor:
        return fused_gemv(x, weight, scale, out_features, in_features, "rms",
                          norm_weight=norm_weight, eps=eps, offset=offset, kernel=kernel,
                          conv_state=state, conv_weight=conv_weight, beta=beta)

    if key not in CHOICES and not torch.cuda.is_current_stream_capturing():
        # timed on a copy of the state: each timed call rolls the windows it is given
        scratch = conv_state.clone()
        names = candidates(out_features, in_features, x.shape[0], scale is not None, 1,
                           tma_offered(weight, x))
        timed_choice(CHOICES, key, names, DEFAULT, True,
                     lambda kernel, w, s: run(kernel, w, s, scratch), (weight, scale))
    return run(CHOICES.get(key, DEFAULT), weight, scale)


@fused_in_proj_conv.register_fake
def _(x, weight, scale, out_features, in_features, norm_weight, eps, offset, conv_state,
      conv_weight, beta_start=-1, beta_heads=0, beta_double=False):
    return x.new_empty(x.shape[0], out_features)
