"""The int4 draft's linears with their small kernels folded in (unimax.fused_draft), as the FP8
draft's are (ops.fused_gemv, ops.in_proj_conv): ``int4_fused_linear`` (a prologue: RMSNorm, the
gated norm, SwiGLU, the sigmoid gate; and the residual add) and ``int4_in_proj_conv`` (RMSNorm,
the short convolution and beta in the epilogue), two launches each (below), for one-token steps.

Why: unfused, the int4 draft's 4B step (H200, bench/verified.py --kernels)
was 454 kernels, its four int4 GEMVs a layer 1032 us of 1708 busy, with ~360 us of small
inductor kernels (norms, x made ready, gates) and the gaps between them, and took 1.841 ms a
step against the fused FP8 draft's ~1.75: the GEMVs' savings spent on launches.

How: two launches a linear. int4_gemv_kernels.int4_ready_kernel runs the prologue and writes x
ready (ops.int4_gemv.prepare_x's form), a slice a program; int4_epilogue_kernel is
ops.int4_gemv's GEMV on it with the epilogue (the convolution, beta, the residual). The first
form ran the prologue inside the GEMV, each program over all of x before its tile: measured
(bench/int4_gemv.py --fused) that cost the 4B body 2170 us a step against
1059 on x made ready, so it was replaced. This form costs ~1.7 us a linear over the ready GEMV,
1269 us a step against 1470 for the fused FP8 forms, and is the default
(the kernel configuration's fuse_int4). Under programmatic dependent launch (ops.pdl.pdl_launch: the
draft's setting, as for its FP8 GEMVs; compute capability 9+, so not on an L4) the ready
kernel lets the GEMV launch at once, which reads its first tile of W before it waits for x:
that launch's gap is what the second form added, and PDL hides nearly all of it (1099
us a step with the signal at the end, against 1066 on x made ready).

``int4_fused_ref`` is the twin: the prologue's torch form (ops.fused_gemv.prologue_ref), x
rounded as the kernel takes it, the dequantized weight in fp32, then the convolution, beta and
the residual as ops.in_proj_conv's twin.
"""

from __future__ import annotations

from typing import Optional

import torch

from .choices import ChoiceTable
from .fused_gemv import PROLOGUES, _head, check, check_conv, prologue_ref
from .gemv import _interpreted, tile_text, timed_choice
from .in_proj_conv import check_beta, conv_and_beta_ref
from .int4_gemv import _tile, check_storage, int4_linear_ref, tiles_for
from .pdl import pdl_launch

PRE_BLOCK = 1024  # a prologue program's slice of x (at least one head)
CHOICES = ChoiceTable("int4_fused")  # (prologue, residual?, conv?, N, K, group) -> tile text


def int4_fused_ref(x, packed, scale, prologue: str, norm_weight=None, z=None, residual=None,
                   eps: float = 1e-6, offset: float = 0.0, conv_state=None, conv_weight=None,
                   beta: tuple[int, int, bool] | None = None) -> torch.Tensor:
    """The twin (module docstring); conv_state rolled in place with conv_weight, and beta
    (the in-projection's) with it."""
    xin = prologue_ref(x, prologue, 2 * packed.shape[1], norm_weight, z, eps, offset)
    y = int4_linear_ref(xin, packed, scale)
    if conv_weight is not None:
        y = conv_and_beta_ref(y, conv_state, conv_weight, *(beta or (-1, 0, False)))
    return y if residual is None else residual + y


def check_int4(x, packed, scale, prologue: str, norm_weight, z, residual) -> None:
    """Names what does not fit: the fused GEMV's checks on the weight's logical shape, and the
    int4 storage."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    check(x, torch.empty(n, k, device="meta"), n, k, prologue, norm_weight, z, residual)
    check_storage(packed, scale, "int4_fused")


def int4_fused(x, packed, scale, prologue: str, norm_weight=None, z=None, residual=None,
               eps: float = 1e-6, offset: float = 0.0, conv_state=None, conv_weight=None,
               beta: tuple[int, int, bool] | None = None,
               tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernels (CUDA, or the interpreter): the prologue's launch, then the GEMV's,
    x one row; the twin's contract. ``tile``: the GEMV's, one of ops.int4_gemv.tiles_for (the
    first where None)."""
    import triton

    from .int4_gemv_kernels import int4_epilogue_kernel, int4_ready_kernel

    check_int4(x, packed, scale, prologue, norm_weight, z, residual)
    if x.shape[0] != 1:
        raise ValueError(f"int4_fused: one row at a time, got {x.shape[0]}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    group = k // scale.shape[1]
    if conv_state is not None:
        check_conv(x, n, conv_state, conv_weight)
    elif beta is not None:
        raise ValueError("int4_fused: beta is the in-projection's, with the convolution")
    block_n, block_k, warps = tile or tiles_for(k, group)[0]
    head = _head(prologue, norm_weight)
    pre_block = max(PRE_BLOCK, head)
    ready = torch.empty(k, device=x.device, dtype=torch.float16)
    pdl = pdl_launch(x, packed)  # (the draft's setting: the packed bytes are one-byte weights)
    int4_ready_kernel[(triton.cdiv(k, pre_block),)](
        x, x if z is None else z, x if norm_weight is None else norm_weight, ready, k, eps,
        offset, PRO=PROLOGUES.index(prologue), HEAD=head,
        KP=triton.next_power_of_2(k) if prologue == "rms" else 1, PRE_BLOCK=pre_block,
        num_warps=4, **({"PDL": True, "launch_pdl": True} if pdl else {}))
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    width = 0 if conv_weight is None else conv_weight.shape[1]
    conv = (y, y, 0, 0) if conv_state is None else (conv_state, conv_weight,
                                                    conv_weight.shape[0], conv_state.stride(0))
    int4_epilogue_kernel[(triton.cdiv(n, block_n),)](
        ready, packed, scale, x if residual is None else residual, y, n, k, packed.stride(0),
        scale.stride(0), *conv, *((0, 0) if beta is None else beta[:2]),
        HAS_RES=residual is not None, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
        CONV_W=width, CONV_WP=triton.next_power_of_2(max(width, 1)),
        BETA=0 if beta is None else 1 + bool(beta[2]), PTX=not _interpreted(),
        num_warps=warps, **pdl)
    return y


def chosen(key: tuple, packed, scale, run) -> tuple[int, int, int]:
    """The tile for ``key``, timed once over ops.int4_gemv.tiles_for (ops.gemv.timed_choice;
    ``run(name, packed, scale)`` one call at tile ``name``); the first where untimed."""
    name = CHOICES.get(key)
    if name is None:
        k = 2 * packed.shape[1]
        names = tuple(tile_text(t) for t in tiles_for(k, k // scale.shape[1]))
        name = timed_choice(CHOICES, key, names, names[0], True, run, (packed, scale))
    return _tile(name)


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::int4_fused_linear", mutates_args=())
def int4_fused_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      prologue: str, norm_weight: Optional[torch.Tensor],  # noqa: UP045
                      z: Optional[torch.Tensor],  # noqa: UP045
                      residual: Optional[torch.Tensor],  # noqa: UP045
                      eps: float, offset: float) -> torch.Tensor:
    """prologue(x) @ dequant(W)^T (+ residual), x one row: the fused kernel at its timed tile
    on CUDA, the twin elsewhere."""
    if not x.is_cuda:
        check_int4(x, packed, scale, prologue, norm_weight, z, residual)
        return int4_fused_ref(x, packed, scale, prologue, norm_weight, z, residual, eps,
                              offset)

    def run(name: str, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return int4_fused(x, packed, scale, prologue, norm_weight, z, residual, eps, offset,
                          tile=_tile(name))

    key = (prologue, residual is not None, False, packed.shape[0], 2 * packed.shape[1],
           scale.shape[1])
    return run(tile_text(chosen(key, packed, scale, run)), packed, scale)


@int4_fused_linear.register_fake
def _(x, packed, scale, prologue, norm_weight, z, residual, eps, offset):
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("unimax::int4_in_proj_conv", mutates_args=("conv_state",))
def int4_in_proj_conv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, offset: float,
                      conv_state: torch.Tensor, conv_weight: torch.Tensor,
                      beta_start: int = -1, beta_heads: int = 0,
                      beta_double: bool = False) -> torch.Tensor:
    """ops.in_proj_conv.fused_in_proj_conv for an int4 weight: RMSNorm(x) @ dequant(W)^T, its
    first conv_weight.shape[0] channels through the causal convolution (conv_state rolled in
    place), the b channels as beta with ``beta_heads``."""
    n = packed.shape[0]
    check_beta(n, conv_weight.shape[0], beta_start, beta_heads)
    beta = (beta_start, beta_heads, beta_double) if beta_heads else None
    if not x.is_cuda:
        check_int4(x, packed, scale, "rms", norm_weight, None, None)
        check_conv(x, n, conv_state, conv_weight)
        return int4_fused_ref(x, packed, scale, "rms", norm_weight, None, None, eps, offset,
                              conv_state, conv_weight, beta)

    def run(name: str, packed: torch.Tensor, scale: torch.Tensor,
            state: torch.Tensor = conv_state) -> torch.Tensor:
        return int4_fused(x, packed, scale, "rms", norm_weight, None, None, eps, offset,
                          state, conv_weight, beta, tile=_tile(name))

    key = ("rms+conv", False, True, n, 2 * packed.shape[1], scale.shape[1])
    if key not in CHOICES and not torch.cuda.is_current_stream_capturing():
        scratch = conv_state.clone()  # (each timed call rolls the windows it is given)
        chosen(key, packed, scale, lambda name, p, s: run(name, p, s, scratch))
    return run(tile_text(chosen(key, packed, scale, run)), packed, scale)


@int4_in_proj_conv.register_fake
def _(x, packed, scale, norm_weight, eps, offset, conv_state, conv_weight, beta_start=-1,
      beta_heads=0, beta_double=False):
    return x.new_empty(x.shape[0], packed.shape[0])
