"""Int4 linears for an opt-in draft: every linear of the body in 4 bits with an FP16 scale per
group of columns, the LM head at FP8 (``quantize_view(model, "int4")``; build_engine's
``draft="int4"``), for verified mode only.

Why a second draft format beside the full-FP8 one: at 4B on the H200 the FP8 draft step costs 0.64
of a BF16 step, about half of it the weights' bytes, and the block model wants <= 0.6 for verified
mode to gain at acceptance 0.95. Four bits halve those bytes: the body's four linears take ~1050 us
a step in int4 against ~1470 in the fused FP8 forms (bench/int4_gemv.py, H200). Built unfused (these
modules in inductor's compiled step), the whole 4B draft step took 0.69 BF16 steps against the fused
FP8 draft's ~0.64, its small kernels and launches spending the saving. So the compiled draft folds
them into its int4 linears as the FP8 draft does (unimax.fused_draft, ops.int4_fused; the kernel
configuration's fuse_int4, on), the second launch of each linear under programmatic dependent launch
where the card has it: 0.550 BF16 steps against full FP8's 0.643, verified 1.58x / 1.34x BF16-only
at forced acceptance 1.0 / 0.95 against 1.40x / 1.18x (gdn-4b, same run; 0.605 and 1.48x / 1.25x
without PDL). At the launch-bound 0.8B shapes it only draws level with full FP8 (0.828 against
0.829). What it costs: acceptance (the demo model kept 0.94 of its drafts with int4/128 and an FP8
head against FP8's 0.963, bench/draft_bits.py). The verified output is the exact model's greedy
tokens whatever the draft computes.

The format is bench/draft_bits.py's ``int4/G``: symmetric, q = round(w / s) in -7..7, s = the
group's absmax / 7, stored as q + 8, column 2j in byte j's low nibble and 2j + 1 in its high
one (ops.int4_gemv reads that layout); the scale in FP16 (a group whose absmax is below ~4e-7
rounds to zero there: its weights are lost, a draft's rounding).
"""

from __future__ import annotations

import torch
from torch import nn

from .ops.int4_format import (  # noqa: F401 (the format's functions, as unimax.int4's)
    dequantize_int4,
    dequantize_packed,
    pack_nibbles,
    quantize_int4,
    quantize_packed,
    unpack_nibbles,
)
from .ops.int4_gemv import int4_linear_ref, int4_matvec, prepare_x

GROUP = 128  # columns per scale (draft_bits' int4/128)


def group_for(k: int) -> int | None:
    """The group size for K columns: GROUP, or the largest power of two >= 16 dividing K for a
    small model's narrower linears; None where none does (that linear stays FP8)."""
    group = GROUP
    while group >= 16:
        if k % group == 0:
            return group
        group //= 2
    return None


class Int4Linear(nn.Module):
    """y = x W^T with W in 4 bits (module docstring). One row of x on CUDA: the Triton GEMV
    (ops.int4_gemv) on x made ready by ``prepare_x``; anything else: the twin (the weight
    dequantized, fp32 sums), as the FP8 linears' emulation does."""

    def __init__(self, linear: nn.Linear, group: int):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int4Linear supports bias-free linears only (every GDN linear is)")
        self.in_features, self.out_features, self.group = (linear.in_features,
                                                           linear.out_features, group)
        packed, scale = quantize_packed(linear.weight.detach(), group)
        self.register_buffer("weight", packed)  # (named as the other linears': shapes, device)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.shape[0] == 1:
            y = int4_matvec(prepare_x(x2), self.weight, self.weight_scale, x.dtype)
        else:
            y = int4_linear_ref(x2, self.weight, self.weight_scale)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, int4/{self.group}"
