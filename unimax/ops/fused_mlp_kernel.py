"""The Triton kernel behind unimax.ops.fused_mlp: a one-token FP8 MLP block in one launch.

Program p takes BLOCK_R intermediate units: its rows of gate and up (RMSNorm of x in the
prologue, as the fused GEMV's "rms"), their SwiGLU in registers, then the same units' columns
of down times them, added into an fp32 row of the hidden size with atomics. The last program
to count itself in (as split-K's tiles do, ops.gemv_kernels.split_k_sum) reads that row back
(from L2, where the atomics add), zeroes it for the next launch, scales, rounds, adds the
residual and stores. The loads of both halves' weights do not depend on each other, so the two
GEMVs' fixed latencies overlap.
"""

import triton
import triton.language as tl

from .fused_gemv_kernels import row_rstd, sigmoid
from .gemv_kernels import launch_dependents, wait_for_the_kernel_before


@triton.jit
def gate_up_tiles(gu_ptr, units, inside, k0, H, I, stride_gu, BLOCK_K: tl.constexpr):
    """The gate and up rows of ``units``, columns k0.. (BLOCK_R, BLOCK_K): zeros outside."""
    rk = k0 + tl.arange(0, BLOCK_K)
    m = inside[:, None] & (rk < H)[None, :]
    wg = tl.load(gu_ptr + units[:, None] * stride_gu + rk[None, :], mask=m, other=0.0)
    wu = tl.load(gu_ptr + (I + units)[:, None] * stride_gu + rk[None, :], mask=m, other=0.0)
    return wg, wu


@triton.jit
def tile_products(acc_g, acc_u, wg, wu, x_ptr, nw_ptr, k0, H, rstd, offset,
                  BLOCK_K: tl.constexpr):
    """acc_g, acc_u plus the tiles times RMSNorm(x)'s slice k0.., rounded to x's dtype as
    the fused GEMV's "rms" prologue rounds it (x_math)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    kin = rk < H
    x = tl.load(x_ptr + rk, mask=kin, other=0.0)
    w = tl.load(nw_ptr + rk, mask=kin, other=0.0)
    xn = (x.to(tl.float32) * rstd * (offset + w.to(tl.float32))).to(x.dtype).to(tl.float32)
    return acc_g + wg.to(tl.float32) * xn[None, :], acc_u + wu.to(tl.float32) * xn[None, :]


@triton.jit
def fused_mlp_kernel(x_ptr, nw_ptr, gu_ptr, gus_ptr, d_ptr, ds_ptr, y_ptr, acc_ptr, cnt_ptr,
                     H, I, stride_gu, stride_d, eps, offset,
                     HP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                     PDL_LATE: tl.constexpr = False):
    """``PDL``, ``PDL_LATE``: as the fused GEMV's (fused_gemv_kernels.fused_gemv_kernel):
    launched programmatically, the next kernel may start at once (or, late, once this one's
    programs are past their loads), and the first tiles of gate and up, which no kernel
    writes, are read before waiting for the kernel before; x and the shared row only after.
    Without PDL those tiles are still read before the norm's pre-pass over x."""
    p = tl.program_id(0)
    units = p * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = units < I
    if PDL and not PDL_LATE:
        launch_dependents()
    wg, wu = gate_up_tiles(gu_ptr, units, inside, 0, H, I, stride_gu, BLOCK_K)
    if PDL:
        wait_for_the_kernel_before()
    rstd = row_rstd(x_ptr, 0, H, 0, eps, HP, BLOCK_K)
    acc_g = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    acc_g, acc_u = tile_products(acc_g, acc_u, wg, wu, x_ptr, nw_ptr, 0, H, rstd, offset,
                                 BLOCK_K)
    for k0 in range(BLOCK_K, H, BLOCK_K):
        wg, wu = gate_up_tiles(gu_ptr, units, inside, k0, H, I, stride_gu, BLOCK_K)
        acc_g, acc_u = tile_products(acc_g, acc_u, wg, wu, x_ptr, nw_ptr, k0, H, rstd, offset,
                                     BLOCK_K)
    # gate-up's output, scaled and rounded as the GEMV's store rounds it; then SwiGLU as the
    # fused GEMV's "swiglu" prologue rounds it (silu rounded, then the product)
    g = tl.sum(acc_g, axis=1) * tl.load(gus_ptr + units, mask=inside, other=0.0)
    u = tl.sum(acc_u, axis=1) * tl.load(gus_ptr + I + units, mask=inside, other=0.0)
    g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(y_ptr.dtype.element_ty).to(tl.float32)
    silu = (g * sigmoid(g)).to(y_ptr.dtype.element_ty)
    act = (silu.to(tl.float32) * u).to(y_ptr.dtype.element_ty).to(tl.float32)
    act = tl.where(inside, act, 0.0)
    for h0 in range(0, H, BLOCK_H):  # down's columns for these units, into the shared row
        rn = h0 + tl.arange(0, BLOCK_H)
        wd = tl.load(d_ptr + rn[:, None] * stride_d + units[None, :],
                     mask=(rn[:, None] < H) & inside[None, :], other=0.0)
        tl.atomic_add(acc_ptr + rn, tl.sum(wd.to(tl.float32) * act[None, :], axis=1),
                      mask=rn < H)
    if PDL and PDL_LATE:
        launch_dependents()
    tl.debug_barrier()  # every thread's adds issued before the counter moves
    last = tl.atomic_add(cnt_ptr, 1) == tl.num_programs(0) - 1  # (acq_rel, device scope)
    tl.debug_barrier()
    for h0 in range(0, H, BLOCK_H):  # the last program: the row, scaled, rounded, + residual
        rn = h0 + tl.arange(0, BLOCK_H)
        keep = (rn < H) & last
        total = tl.load(acc_ptr + rn, mask=keep, other=0.0, cache_modifier=".cg")  # (L2's)
        tl.store(acc_ptr + rn, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=keep)
        y = (total * tl.load(ds_ptr + rn, mask=keep, other=0.0)).to(y_ptr.dtype.element_ty)
        r = tl.load(x_ptr + rn, mask=keep, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rn, y, mask=keep)
    tl.atomic_xchg(cnt_ptr, 0, mask=last)  # ready for the next launch (graph replays)
