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

``fused_in_proj_conv_ref`` is the twin: the fused GEMV's twin, then ops.conv's one-token
convolution on the first C channels.
"""

from __future__ import annotations

from typing import Optional

import torch

from .conv import causal_conv1d_step
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

FOLD = True  # unimax.fused_draft folds the convolution into the in-projection (bench: off)
# the kernel where none was timed (a key first met in a capture): a named tile, never
# autotuned (the autotuner would rerun the kernel on the live state)
DEFAULT = f"rows@{tile_text(CONV_TILE)}"


def fused_in_proj_conv_ref(x, weight, scale, out_features: int, in_features: int,
                           norm_weight, eps: float, offset: float, conv_state,
                           conv_weight) -> torch.Tensor:
    """The twin: the projection (fused_small_m_linear_ref, "rms"), then the convolution of its
    first channels (ops.conv.causal_conv1d_step), the state written with copy_."""
    y = fused_small_m_linear_ref(x, weight, scale, out_features, in_features, "rms",
                                 norm_weight, None, None, eps, offset)
    channels = conv_weight.shape[0]
    conv, window = causal_conv1d_step(y[:, None, :channels], conv_weight,
                                      conv_state[:, :channels])
    conv_state[:, :channels].copy_(window)
    return torch.cat([conv[:, 0], y[:, channels:]], dim=1)


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::fused_in_proj_conv", mutates_args=("conv_state",))
def fused_in_proj_conv(x: torch.Tensor, weight: torch.Tensor,
                       scale: Optional[torch.Tensor],  # noqa: UP045
                       out_features: int, in_features: int, norm_weight: torch.Tensor,
                       eps: float, offset: float, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) @ W^T (* scale), its first conv_weight.shape[0] channels through the causal
    convolution and SiLU, conv_state rolled in place: the fused kernel on CUDA, the twin
    elsewhere."""
    if not x.is_cuda:  # (on CUDA fused_gemv checks the same, once per call)
        check(x, weight, out_features, in_features, "rms", norm_weight, None, None)
        check_conv(x, out_features, conv_state, conv_weight)
        return fused_in_proj_conv_ref(x, weight, scale, out_features, in_features,
                                      norm_weight, eps, offset, conv_state, conv_weight)
    key = ("rms+conv", False, x.shape[0], out_features, in_features, weight.dtype)

    def run(kernel: str, weight: torch.Tensor, scale: torch.Tensor | None,
            state: torch.Tensor = conv_state) -> torch.Tensor:
        return fused_gemv(x, weight, scale, out_features, in_features, "rms",
                          norm_weight=norm_weight, eps=eps, offset=offset, kernel=kernel,
                          conv_state=state, conv_weight=conv_weight)

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
      conv_weight):
    return x.new_empty(x.shape[0], out_features)
