"""GEMVs with the small op before them and the residual add after them folded in, for the
full-FP8 draft step (unimax.fused_draft): ``fused_small_m_linear(x, weight, scale, ...)``.

Why: the draft step of a 4B GDN model is 390 kernels, and the FP8 GEMVs are only ~1.4 of its
~1.9 ms busy time on the H200: the rest is the same small kernels a BF16 step has (the residual
add and RMSNorm before each in- and gate/up-projection, the mixer's gated norm, the SwiGLU, the
gates), ~1.5-2.5 us each whatever their few kilobytes (bench/RESULTS.md,
2026-11-30). Those do not shrink with the weights' bytes, so they hold the draft step at
~0.71 of a BF16 step where its bytes say ~0.5. Each GEMV program reads all of x anyway; here it
reads it through a prologue instead:

- ``rms``: RMSNorm(x) * (offset + w), the norm's factor from one more read of x;
- ``gated_silu`` / ``gated_sigmoid``: the mixer's per-head gated RMSNorm of x, gate z;
- ``swiglu``: silu(gate) * up from the gate/up projection's output (x holds both);
- ``sigmoid_gate``: x * sigmoid(z), gated attention's output before its out-projection;

and ``residual`` adds r to the output as it is stored (x + linear(...)). For the draft, and (the
kernel configuration's fuse_bf16, on) the BF16 fast step and the verifier's one-token forwards; the
exact model itself keeps its own kernels. Up to PROGRAM_ROWS rows, a program per row. The prologues
round where the torch forms round (``fused_small_m_linear_ref``, the twin, is those forms:
unimax.norms).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .. import kernels
from ..norms import gated_rms_norm_ref, rms_norm_ref
from .choices import ChoiceTable
from .gemv import (
    GEMV_TILES,
    MAX_TILES,
    PROGRAM_ROWS,
    _counters,
    _interpreted,
    gemv_ref,
    parse_kernel,
    tile_args,
    tiled_names,
    timed_choice,
)
from .pdl import pdl_launch

PROLOGUES = ("none", "rms", "gated_silu", "gated_sigmoid", "swiglu", "sigmoid_gate")
# Programmatic dependent launch (compute capability 9+): each fused GEMV lets the next start
# early and reads its first weight tile before waiting for the kernel before; whether it is
# asked for, and where the signal goes, is the engine's kernel configuration (unimax.kernels:
# ``pdl``, ``pdl_trigger``), read when a kernel launches, so when a graph is captured.


def prologue_ref(x: torch.Tensor, prologue: str, in_features: int,
                 norm_weight: torch.Tensor | None, z: torch.Tensor | None, eps: float,
                 offset: float) -> torch.Tensor:
    """The linear's input (M, in_features) from x: the torch forms of the prologues."""
    if prologue == "rms":
        return rms_norm_ref(x, norm_weight, eps, offset)
    if prologue in ("gated_silu", "gated_sigmoid"):
        head = norm_weight.shape[0]
        heads = x.reshape(x.shape[0], -1, head)
        out = gated_rms_norm_ref(heads, z.reshape(heads.shape), norm_weight, eps,
                                 prologue.removeprefix("gated_"))
        return out.reshape(x.shape)
    if prologue == "swiglu":
        return F.silu(x[:, :in_features]) * x[:, in_features: 2 * in_features]
    if prologue == "sigmoid_gate":
        return x * torch.sigmoid(z)
    return x


def fused_small_m_linear_ref(x, weight, scale, out_features: int, in_features: int,
                             prologue: str, norm_weight=None, z=None, residual=None,
                             eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """The twin: the prologue's torch form, ``gemv_ref`` on W's first out_features rows and
    in_features columns (an FP8Linear's weight is padded), then the residual add."""
    xin = prologue_ref(x, prologue, in_features, norm_weight, z, eps, offset)
    y = gemv_ref(xin, weight[:out_features, :in_features],
                 None if scale is None else scale[:out_features])
    return y if residual is None else residual + y


def check(x, weight, out_features: int, in_features: int, prologue: str, norm_weight, z,
          residual) -> None:
    """Names what does not fit (the kernel reads by these shapes and strides)."""
    problems = []
    if prologue not in PROLOGUES:
        problems.append(f"prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
    width = 2 * in_features if prologue == "swiglu" else in_features
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        problems.append(f"x must be (M, {width}) with contiguous rows, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] < out_features or weight.shape[1] < in_features \
            or weight.stride(1) != 1:
        problems.append(f"weight {tuple(weight.shape)} must hold ({out_features}, "
                        f"{in_features}) with contiguous rows")
    if prologue in ("rms", "gated_silu", "gated_sigmoid") and norm_weight is None:
        problems.append(f"the {prologue} prologue needs the norm's weight")
    if prologue.startswith("gated"):
        head = 0 if norm_weight is None else norm_weight.shape[0]
        if head & (head - 1) or head == 0 or in_features % head:
            problems.append(f"gated prologue: head size {head} must be a power of 2 dividing "
                            f"{in_features}")
    if (prologue.startswith("gated") or prologue == "sigmoid_gate") and (
            z is None or z.shape != x.shape or z.stride(1) != 1):
        problems.append(f"the {prologue} prologue: z must have x's shape, with contiguous rows")
    if residual is not None and (residual.shape != (x.shape[0], out_features)
                                 or residual.stride(1) != 1):
        problems.append(f"residual must be ({x.shape[0]}, {out_features}) with contiguous rows")
    if problems:
        raise ValueError("fused_small_m_linear: " + "; ".join(problems))


@functools.cache
def tiles_for(head: int) -> tuple[tuple[int, int, int], ...]:
    """The fused kernel's tiles: the GEMV's, with BLOCK_K at least one head (a gated prologue
    normalizes whole heads within a slice)."""
    return tuple(sorted({(n, max(k, head), w) for n, k, w in GEMV_TILES}))


@functools.cache
def _kernel(f16: bool, head: int, tiled: bool = False):
    """The fused kernel, autotuned per (N, K, prologue, residual) over ``tiles_for(head)``;
    ``tiled``: the kernel itself, for a tile given by hand (ops.gemv.tile_args)."""
    import triton

    from .fused_gemv_kernels import fused_gemv_kernel

    if tiled:
        return triton, fused_gemv_kernel, {"F16": f16}
    if _interpreted():
        return triton, fused_gemv_kernel, {"BLOCK_N": 16, "BLOCK_K": max(64, head), "F16": f16}
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
               for n, k, w in tiles_for(head)]
    return (triton, triton.autotune(configs=configs, key=["N", "K", "PRO", "HAS_RES", "SPLIT"])(
        fused_gemv_kernel), {"F16": f16})


# Split-K ("split", "split16": the rows kernels with K in SPLIT_K slices, reduced in the same
# launch by the last program of each tile): offered for FP8 weights where the output is narrow
# (N <= SPLIT_MAX_N: the out- and down-projections, 2560 rows at 4B: only a few hundred
# programs without it) and K at least SPLIT_K x 256 (slices are whole tiles: with wider tiles
# the last slices are empty, which costs only their programs). On the H200 (bench/RESULTS.md)
# it barely helps (down at 4B 0.8 us faster, out_proj slower); the per-shape
# timed choice takes it only where it is faster.
KERNEL_NAMES = ("rows", "rows16", "split", "split16")
SPLIT_K = 4
SPLIT_MAX_N = 4096


def split_tiles_fit(out_features: int, m: int) -> bool:
    """Whether the counters hold every output tile of split-K at the narrowest tile."""
    return -(-out_features // min(n for n, _, _ in GEMV_TILES)) * m <= MAX_TILES


def split_fits(out_features: int, in_features: int, m: int, scaled: bool) -> bool:
    """Whether split-K is offered for this shape (see SPLIT_K)."""
    return (scaled and out_features <= SPLIT_MAX_N and in_features >= SPLIT_K * 256
            and split_tiles_fit(out_features, m))


def fused_gemv(x, weight, scale, out_features: int, in_features: int, prologue: str,
               norm_weight=None, z=None, residual=None, eps: float = 1e-6, offset: float = 0.0,
               kernel: str | None = None, conv_state=None, conv_weight=None,
               beta: tuple[int, int, bool] | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA, or Triton's interpreter), a program per row, M <=
    PROGRAM_ROWS rows; the same contract as the twin. ``kernel``: "rows", or "rows16" (FP16
    products, FP8 weights: see ops.gemv), or either split-K form, "split", "split16" (see
    SPLIT_K: the same sums in slices, added in slice order), each autotuned, or the TMA forms
    "tma", "tma16", "tmasplit", "tmasplit16" (see TMA_FORMS; at TMA_TILE unless named: never
    autotuned, the descriptor's block is the tile's), or any with "@tile" (one of the form's
    tiles for the prologue's head, ``_tiles_by_form``, as ops.gemv.tiled_names writes it).
    ``conv_state``, ``conv_weight``: the first conv_weight.shape[0] outputs go through the
    causal convolution, its state rolled in place (``fused_in_proj_conv``). ``beta``: (start,
    count, doubled): outputs start .. start + count - 1 are stored as sigmoid of the rounded
    output, rounded (times 2, rounded, if doubled): a GDN mixer's write strength."""
    check(x, weight, out_features, in_features, prologue, norm_weight, z, residual)
    if beta is not None and not (0 <= beta[0] and beta[1] > 0
                                 and beta[0] + beta[1] <= out_features):
        raise ValueError(f"fused_gemv: beta channels {beta[0]} .. {beta[0] + beta[1] - 1} "
                         f"must lie within the {out_features} outputs")
    m = x.shape[0]
    head = _head(prologue, norm_weight)
    kernel, tile = parse_kernel(kernel or "rows", _tiles_by_form(head), "fused_gemv")
    if conv_state is not None:
        check_conv(x, out_features, conv_state, conv_weight)
    if m > PROGRAM_ROWS:
        raise ValueError(f"fused_gemv: takes at most {PROGRAM_ROWS} rows, got {m}")
    if kernel.endswith("16") and scale is None:
        raise ValueError(f"fused_gemv: {kernel} (FP16 products) is for FP8 weights only")
    split = SPLIT_K if "split" in kernel else 1
    if split > 1 and not split_tiles_fit(out_features, m):
        raise ValueError(f"fused_gemv: {kernel} takes at most {MAX_TILES} output tiles")
    tma = kernel.startswith("tma")
    if tma:
        problem = tma_problem(weight, x)
        if problem:
            raise ValueError(f"fused_gemv: {kernel}: {problem}; take a rows form")
        tile = tile or (TMA_TILE[0], max(TMA_TILE[1], head), *TMA_TILE[2:])
    elif conv_state is not None and tile is None and not _interpreted():
        tile = CONV_TILE  # (the autotuner would rerun the kernel on the live state)
    triton, launch, fixed = _kernel(kernel.endswith("16"), head, tile is not None)
    y = torch.empty(m, out_features, device=x.device, dtype=x.dtype)
    # split-K's partial sums and counters (rows: unused, any pointer)
    work = (torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
            if split > 1 else y)
    counters = _counters(x.device) if split > 1 else y
    if tma:  # (tile: BLOCK_N, BLOCK_K, warps, stages; the stages are the kernel's STAGES)
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor(weight, [out_features, in_features], [weight.stride(0), 1],
                             list(tile[:2]))
        fixed = {**fixed, "TMA": True, "STAGES": tile[3]}
        tile = tile[:3]
    else:
        w = weight
    pointers = (x, x if z is None else z, x if norm_weight is None else norm_weight, w,
                x if scale is None else scale, x if residual is None else residual, y, work,
                counters)
    strides = (x.stride(0), 0 if z is None else z.stride(0), weight.stride(0),
               0 if residual is None else residual.stride(0), y.stride(0))
    width = 0 if conv_weight is None else conv_weight.shape[1]
    conv = (y, y, 0, 0) if conv_state is None else (conv_state, conv_weight,
                                                    conv_weight.shape[0], conv_state.stride(0))
    # the RMS pre-pass loads the row at once up to 8192 wide
    flags = dict(PRO=PROLOGUES.index(prologue), HEAD=head, HAS_SCALE=scale is not None,
                 HAS_RES=residual is not None,
                 KP=triton.next_power_of_2(in_features) if prologue == "rms" else 1,
                 SPLIT=split, CONV_W=width, CONV_WP=triton.next_power_of_2(max(width, 1)),
                 BETA=0 if beta is None else 1 + bool(beta[2]), **fixed)
    grid = lambda meta: (triton.cdiv(out_features, meta["BLOCK_N"]), m, split)  # noqa: E731
    channels = (0, 0) if beta is None else beta[:2]
    launch[grid](*pointers, out_features, in_features, *strides, eps, offset, *conv,
                 *channels, **flags,
                 **pdl_launch(x, weight), **tile_args(tile))
    return y


CONV_TILE = (16, 256, 4)  # the conv form's tile where none is named (one of GEMV_TILES)


def check_conv(x, out_features: int, conv_state, conv_weight) -> None:
    """Names what does not fit the convolution epilogue (the kernel reads by these layouts)."""
    problems = []
    if conv_weight is None or conv_weight.dim() != 2 or not conv_weight.is_contiguous():
        problems.append("conv_weight must be a contiguous (channels, width) tensor")
    elif not (conv_weight.shape[0] <= out_features and conv_state.dim() == 3
              and conv_state.shape[0] == x.shape[0]
              and conv_state.shape[1] >= conv_weight.shape[0]
              and conv_state.shape[2] == conv_weight.shape[1] and conv_state.stride(2) == 1
              and conv_state.stride(1) == conv_weight.shape[1]):
        problems.append(f"conv_state {tuple(conv_state.shape)} must be ({x.shape[0]}, >= "
                        f"{conv_weight.shape[0]}, {conv_weight.shape[1]}) with contiguous "
                        f"channels, and the channels at most {out_features}")
    if problems:
        raise ValueError("fused_gemv: " + "; ".join(problems))


def _head(prologue: str, norm_weight: torch.Tensor | None) -> int:
    """The width a gated prologue normalizes over (one head); 1 for the others."""
    return norm_weight.shape[0] if prologue.startswith("gated") else 1


# TMA forms ("tma", "tma16", and split-K "tmasplit", "tmasplit16": the rows and split forms
# with W's tiles through the Tensor Memory Accelerator, STAGES - 1 tiles in flight per program
# ahead of its products, and x's slices loaded a tile ahead; see the kernel's TMA). Why: under
# Nsight Compute the short GEMVs wait on their K loop's chain of dependent
# DRAM round trips (~1.2 us each: in_proj's 10 tiles take 13 us), with DRAM at 28-66% of its
# peak and occupancy set by the grid; no plain-load form keeps more than one tile in flight per
# program (Triton pipelines only TMA loads and loads that feed tl.dot), and the forms that
# tried otherwise lost: two tiles in registers, whole-K tiles (1.05-1.7x
# slower on every 4B linear: each program redoes x's prologue for 2-4
# rows), L2 prefetches (fifteenth). Tiles are (BLOCK_N, BLOCK_K, warps, stages), BLOCK_K at
# most 256 (a TMA box's limit) and at least one head. Offered on compute capability 9+ (an L4
# has no TMA) where W's layout allows a descriptor (``tma_problem``), the split forms where
# split-K is (``split_fits``); the timed choice takes one only where it is faster. Measured
# (bench/tma_gemv.py, FP8, x loaded a tile ahead): in_proj 5% faster than
# its plain choice, gate_up 8% slower, and the K-long narrow ones (out_proj, down: 80-160
# programs of 16-36 tiles) 1.3x slower, the case split-K serves in the plain forms: hence the
# TMA split forms. Those (bench/tma_gemv.py): down 10.35 us against
# split16's 11.22 (-8%), out_proj 7.93 against rows' 7.23 (+10%); gate_up's best TMA form
# 16.82 against rows16's 15.63; in_proj 12.14 against 12.68 (-4%).
TMA_FORMS = ("tma", "tma16", "tmasplit", "tmasplit16")
TMA_TILES = ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4))  # (8 x 256 and 6 stages:
# slower at every 4B linear on the H200)
# The tiles the timed choice is offered: each one a Triton compile per shape and prologue at
# warm-up, and with all three a GPU test file's warm-ups ran past its 10 minutes. 32 x 256 was
# the best TMA tile or within 3% of it at every 4B linear and form (and 3 or 5 stages were no
# better than 4 on the K-long ones); the others stay nameable for benches.
TMA_OFFERED = ((32, 256, 4, 4),)
# where none is named (never autotuned: the descriptor's block is the tile's)
TMA_TILE = TMA_OFFERED[0]
TMA_MAX_K = 256  # a TMA box's limit on BLOCK_K


def _tma_tiles(tiles: tuple, head: int) -> tuple:
    """``tiles`` with BLOCK_K at least one head, those past a TMA box's limit left out."""
    return tuple((n, max(k, head), w, s) for n, k, w, s in tiles if max(k, head) <= TMA_MAX_K)


@functools.cache
def _tiles_by_form(head: int, offered: bool = False) -> dict[str, tuple]:
    """Each form's tiles (what a kernel name may carry; with ``offered``, the TMA forms' only
    at TMA_OFFERED: what the timed choice is given), BLOCK_K at least one head."""
    tma = _tma_tiles(TMA_OFFERED if offered else TMA_TILES, head)
    return {**dict.fromkeys(KERNEL_NAMES, tiles_for(head)),
            **dict.fromkeys(TMA_FORMS, tma)}


def tma_problem(weight: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why W's tiles cannot come through TMA here (None: they can): the device (compute
    capability 9+, or Triton's interpreter), and the descriptor's layout rules."""
    hopper = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    if not (hopper or _interpreted()):
        return "TMA needs compute capability 9.0 or newer (Hopper)"
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
        return (f"TMA needs W 16-byte aligned with 16-byte aligned rows (row stride "
                f"{weight.stride(0)} x {weight.element_size()} bytes)")
    return None


def tma_offered(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the timed choice is offered the TMA forms for this weight (the kernel
    configuration's ``tma`` on, read at the choice, and nothing in ``tma_problem``)."""
    return kernels.active().tma and tma_problem(weight, x) is None


CHOICES = ChoiceTable("fused_gemv")  # (prologue, residual?, M, N, K, weight dtype) -> kernel


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::fused_small_m_linear", mutates_args=())
def fused_small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                         scale: Optional[torch.Tensor],  # noqa: UP045
                         out_features: int, in_features: int, prologue: str,
                         norm_weight: Optional[torch.Tensor],  # noqa: UP045
                         z: Optional[torch.Tensor],  # noqa: UP045
                         residual: Optional[torch.Tensor],  # noqa: UP045
                         eps: float, offset: float) -> torch.Tensor:
    """prologue(x) (M <= PROGRAM_ROWS rows) @ W^T (* scale) (+ residual): on CUDA the fused
    Triton kernel, a program per row, its kernel chosen per shape; the twin elsewhere. (Folded
    blocks fold one-token forwards only: unimax.fused_draft.)"""
    if not x.is_cuda:
        check(x, weight, out_features, in_features, prologue, norm_weight, z, residual)
        return fused_small_m_linear_ref(x, weight, scale, out_features, in_features, prologue,
                                        norm_weight, z, residual, eps, offset)
    if x.shape[0] > PROGRAM_ROWS:
        raise ValueError(f"fused_small_m_linear: {x.shape[0]} rows, more than PROGRAM_ROWS "
                         f"({PROGRAM_ROWS}); larger forwards take the plain forms")
    key = (prologue, residual is not None, x.shape[0], out_features, in_features,
           weight.dtype)

    def run(kernel: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return fused_gemv(x, weight, scale, out_features, in_features, prologue,
                    norm_weight=norm_weight, z=z, residual=residual, eps=eps, offset=offset,
                    kernel=kernel)

    if key in CHOICES:  # (every call after the first: no names to build)
        return run(CHOICES[key], weight, scale)
    head = _head(prologue, norm_weight)
    names = candidates(out_features, in_features, x.shape[0], scale is not None, head,
                       tma_offered(weight, x))
    return run(timed_choice(CHOICES, key, names, "rows", True, run, (weight, scale)), weight,
               scale)


def candidates(out_features: int, in_features: int, m: int, scaled: bool,
               head: int, tma: bool = False) -> tuple[str, ...]:
    """The kernel names the per-shape choice times: every form at every one of its tiles
    (rows16 for FP8 weights only, split-K where ``split_fits``, the TMA forms at TMA_OFFERED
    where ``tma`` and K holds at least two of their tiles: see TMA_FORMS), timed as a step
    runs them (ops.gemv.timed_choice)."""
    forms = ("rows", "rows16") if scaled else ("rows",)
    if split_fits(out_features, in_features, m, scaled):
        forms += ("split", "split16")
    if tma and in_features >= 2 * TMA_MAX_K:  # (one or two tiles: nothing to pipeline)
        forms += ("tma", "tma16") if scaled else ("tma",)
        if split_fits(out_features, in_features, m, scaled):
            forms += ("tmasplit", "tmasplit16")
    return tiled_names(forms, _tiles_by_form(head, offered=True))


@fused_small_m_linear.register_fake
def _(x, weight, scale, out_features, in_features, prologue, norm_weight, z, residual, eps,
      offset):
    return x.new_empty(x.shape[0], out_features)
