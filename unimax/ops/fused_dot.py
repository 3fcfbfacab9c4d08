"""The fused GEMVs' prologues and residual add (ops.fused_gemv) for a verifier block's rows, on
the tensor cores: ``fused_dot(x, weight, scale, ..., kernel)``, M from PROGRAM_ROWS + 1 to
GEMV_ROWS rows, W read once for all of them.

Why: a verify block's GEMMs (ops.gemv's "dot" and "dotsplit") read the weights at the
one-token GEMVs' speed, but between them run the norms the one-token forwards fold into their
GEMVs: per GDN layer the residual add and RMSNorm twice and the gated norm's two kernels,
~7 us a layer at 4B and ~5 at 0.8B on the H200, where the whole 0.8B block is ~58 us a layer
(bench/RESULTS.md, thirty-first session). Here each GEMM reads x through the same prologue as
the one-row forms, rounded where the torch forms round, and adds the residual as it stores.

A first tensor-core form (ninth session) was exact but 3.5x slower than the GEMMs it replaced:
it had no split-K, so the K-long narrow linears (out- and down-projections) ran a few dozen
programs on 132 SMs. This one has dot_kernel's split-K and PDL, loads x's slices a tile ahead
(fused_dot_kernels), and takes its tile from a timed choice among the plain GEMM's own choice
for the shape and a default of each form. Used where the verifier's view folds its blocks
(unimax.verifier.FOLD_BLOCKS, off); the twin is fused_gemv's, the torch forms.

Measured (H200, thirty-first session, bench/fused_dot.py, 4B linears at 9 rows, BF16, best
tile each, us): in-projection with RMS 24.4 against the plain GEMM's 18.4, out-projection with
the gated norm and residual 13.2 against 9.8, gate-up with RMS 31.3 against 27.5, down with
SwiGLU and residual 19.8 against 16.8 (before the tile-ahead loads: 23.4, 17.7, 37.0, 37.4).
That is +16 us a layer where the four norm kernels it removes cost ~7.5: still slower, hence
off. What it costs: a prologue's slice is not a tl.dot operand Triton pipelines, and the RMS
factor needs a pre-pass over the rows in every program.
"""

from __future__ import annotations

import functools

import torch

from .gemv import (
    DOT_TILES,
    DOTSPLIT_TILE,
    DOTSPLIT_TILES,
    GEMV_ROWS,
    MAX_TILES,
    PROGRAM_ROWS,
    _counters,
    _interpreted,
    dot_rows,
    dotsplit_fits,
    parse_kernel,
    tile_args,
    tile_text,
)

FORMS = ("dot", "dotsplit")
DOT_TILE = (64, 256, 4, 3)  # "dot" where none is named (one of DOT_TILES)


def widen(tile: tuple[int, ...], head: int) -> tuple[int, ...]:
    """``tile`` with BLOCK_K at least one head (a gated prologue normalizes whole heads within
    a slice)."""
    n, k, *rest = tile
    return (n, max(k, head), *rest)


@functools.cache
def tiles_by_form(head: int) -> dict[str, tuple]:
    """Each form's tiles: ops.gemv's, ``widen``ed."""
    return {form: tuple(dict.fromkeys(widen(tile, head) for tile in tiles))
            for form, tiles in (("dot", DOT_TILES), ("dotsplit", DOTSPLIT_TILES))}


def default_tile(form: str, head: int) -> tuple[int, ...]:
    return widen(DOT_TILE if form == "dot" else DOTSPLIT_TILE, head)


def fused_dot(x, weight, scale, out_features: int, in_features: int, prologue: str,
              norm_weight=None, z=None, residual=None, eps: float = 1e-6, offset: float = 0.0,
              kernel: str | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA, or Triton's interpreter) for PROGRAM_ROWS < M <= GEMV_ROWS
    rows; the contract of fused_gemv's twin. ``kernel``: "dot" or "dotsplit" (K in slices,
    reduced in the same launch), at their default tile or with "@tile" (one of
    ``tiles_by_form(head)``)."""
    from .fused_gemv import PROLOGUES, _head, check, pdl_launch

    check(x, weight, out_features, in_features, prologue, norm_weight, z, residual)
    m = x.shape[0]
    if not PROGRAM_ROWS < m <= GEMV_ROWS:
        raise ValueError(f"fused_dot: takes {PROGRAM_ROWS + 1} to {GEMV_ROWS} rows, got {m}")
    head = _head(prologue, norm_weight)
    form, tile = parse_kernel(kernel or "dot", tiles_by_form(head), "fused_dot")
    tile = tile or default_tile(form, head)
    *tile, split = tile if form == "dotsplit" else (*tile, 1)
    tiles = -(-out_features // tile[0])
    if split > 1 and tiles > MAX_TILES:
        raise ValueError(f"fused_dot: dotsplit takes at most {MAX_TILES} output tiles, "
                         f"got {tiles}")
    from .fused_dot_kernels import fused_dot_kernel  # (Triton: CUDA or its interpreter)

    y = torch.empty(m, out_features, device=x.device, dtype=x.dtype)
    work = (torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
            if split > 1 else y)
    counters = _counters(x.device) if split > 1 else y
    block_m = dot_rows(m)
    fused_dot_kernel[(tiles, split)](
        x, x if z is None else z, x if norm_weight is None else norm_weight, weight,
        x if scale is None else scale, x if residual is None else residual, y, work, counters,
        m, out_features, in_features, x.stride(0), 0 if z is None else z.stride(0),
        weight.stride(0), 0 if residual is None else residual.stride(0), y.stride(0), eps,
        offset, PRO=PROLOGUES.index(prologue), HEAD=head, HAS_SCALE=scale is not None,
        HAS_RES=residual is not None, BLOCK_M=block_m, DOT_F32=_interpreted(),
        RK=64 if _interpreted() else 8192 // block_m,  # (the RMS pre-pass's slice: 8192 fp32)
        SPLIT=split, **pdl_launch(x, weight), **tile_args(tuple(tile)))
    return y


def candidates(x: torch.Tensor, weight: torch.Tensor, scale, out_features: int,
               in_features: int, head: int) -> tuple[str, ...]:
    """What the per-shape choice times: the plain GEMM's own choice for this shape (ops.gemv,
    timed there: its tile, BLOCK_K widened to a head), "dot" at DOT_TILE, and "dotsplit" at
    DOTSPLIT_TILE where ``dotsplit_fits``. Three compiles per shape and prologue at most,
    where timing every tile of both forms would be fourteen."""
    from . import gemv

    m = x.shape[0]
    plain = gemv.choose(x.new_zeros(m, in_features), weight[:out_features, :in_features], None
                        if scale is None else scale[:out_features])
    names = [f"dot@{tile_text(default_tile('dot', head))}"]
    if dotsplit_fits(m, out_features, in_features):
        names.append(f"dotsplit@{tile_text(default_tile('dotsplit', head))}")
    if plain.partition("@")[0] in FORMS:  # (not cuBLAS)
        form, tile = parse_kernel(plain, gemv.TILES, "fused_dot")
        if tile is not None:  # (None: autotuned, where the choice could not be timed)
            names.insert(0, f"{form}@{tile_text(widen(tile, head))}")
    return tuple(dict.fromkeys(names))
