"""The Triton kernel behind unimax.ops.fused_dot: gemv_kernels.dot_kernel (all rows of a
verifier block against a tile of W on the tensor cores, split-K and PDL as there) with the
fused GEMVs' prologues folded into how it reads x and their residual add into its store
(fused_gemv_kernels.py has the one-row forms; the prologue numbers are theirs).

A prologue costs a program a few operations per element of its (BLOCK_M, BLOCK_K) slice of x
against BLOCK_N x BLOCK_K weights; the RMS prologue also a pre-pass over the rows (from L2),
for the norm's factor before the first product, as the torch form applies it. The kernel it
replaces is a launch of ~1.5-2 us for a few kilobytes (four a GDN layer in a verify block).
"""

import triton
import triton.language as tl

from .fused_gemv_kernels import sigmoid
from .fused_gemv_kernels import x_math as row_math
from .gemv_kernels import (
    dot_tile,
    dot_w_tile,
    k_slice,
    launch_dependents,
    split_k_sum,
    tile_dot,
    wait_for_the_kernel_before,
)


@triton.jit
def rows_rstd(x_ptr, rm, M, K, stride_xm, eps, BLOCK_M: tl.constexpr, RK: tl.constexpr):
    """1 / sqrt(mean(x[m]^2) + eps) in fp32 for every row of the block ((BLOCK_M,)), K in
    slices of RK (a whole 16-row block at once would not fit a program's registers)."""
    squares = tl.zeros((BLOCK_M, RK), dtype=tl.float32)
    for k0 in range(0, K, RK):
        rk = k0 + tl.arange(0, RK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def x_loads(x_ptr, z_ptr, nw_ptr, rm, rk, M, K, stride_xm, stride_zm, PRO: tl.constexpr,
            HEAD: tl.constexpr):
    """The loads x_math needs for the rows rm of x's slice rk: x, and per prologue the norm's
    weight (RMS, GATED_*), z (GATED_*, SIGMOID_GATE) or the up half (SWIGLU); x where a
    prologue needs less. Apart from the math so that the loop issues the next slice's loads
    before this slice's products (see fused_dot_kernel)."""
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
    a = x
    b = x
    if PRO == 1:
        a = tl.load(nw_ptr + rk, mask=rk < K, other=0.0)[None, :].broadcast_to(x.shape)
    elif PRO == 2 or PRO == 3:
        a = tl.load(z_ptr + rm[:, None] * stride_zm + rk[None, :], mask=mask, other=0.0)
        b = tl.load(nw_ptr + rk % HEAD)[None, :].broadcast_to(x.shape)
    elif PRO == 4:
        a = tl.load(x_ptr + rm[:, None] * stride_xm + K + rk[None, :], mask=mask, other=0.0)
    elif PRO == 5:
        a = tl.load(z_ptr + rm[:, None] * stride_zm + rk[None, :], mask=mask, other=0.0)
    return x, a, b


@triton.jit
def x_math(x, a, b, rstd, eps, offset, PRO: tl.constexpr, HEAD: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A (BLOCK_M, BLOCK_K) slice of x as the linear's input, from x_loads' values: through
    the prologue, rounded where the torch forms round, in their order of operations. The
    one-row forms' x_math (elementwise, rstd per row) but for GATED_*: per head of HEAD
    (BLOCK_K holds whole heads), each row's heads apart."""
    if PRO == 2 or PRO == 3:
        heads = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // HEAD, HEAD))
        r = tl.rsqrt(tl.sum(heads * heads, axis=2) / HEAD + eps)
        w = tl.reshape(b.to(tl.float32), (BLOCK_M, BLOCK_K // HEAD, HEAD))
        z = tl.reshape(a.to(tl.float32), (BLOCK_M, BLOCK_K // HEAD, HEAD))
        gate = z * sigmoid(z) if PRO == 2 else sigmoid(z)
        x = tl.reshape(heads * r[:, :, None] * w * gate, (BLOCK_M, BLOCK_K)).to(x.dtype)
    else:
        x = row_math(x, a, b, rstd[:, None], eps, offset, PRO, HEAD, BLOCK_K)
    return x


@triton.jit
def fused_dot_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, s_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, M, N,
                     K, stride_xm, stride_zm, stride_wn, stride_rm, stride_ym, eps, offset,
                     PRO: tl.constexpr, HEAD: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, RK: tl.constexpr,
                     SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False,
                     PDL_LATE: tl.constexpr = False):
    """y[rm, rn] = (prologue(x[rm]) @ W[rn]^T) * s[rn] (+ r[rm, rn]) for M <= BLOCK_M rows.

    dot_kernel's loop, x read through x_loads and x_math; ``SPLIT`` > 1 (split-K) and ``PDL`` as
    there: under PDL the first W tile is loaded before the wait, the RMS pre-pass (it reads x,
    which the kernel before writes) after it. The linear's output is rounded to y's dtype,
    then the residual added and rounded once more, as the unfused forms round."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    start, end = k_slice(K, part, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if PDL:
        if not PDL_LATE:
            launch_dependents()
        rk = start + tl.arange(0, BLOCK_K)
        w = dot_w_tile(w_ptr, rn, rk, N, K, stride_wn)
        wait_for_the_kernel_before()
        if PRO == 1:
            rstd = rows_rstd(x_ptr, rm, M, K, stride_xm, eps, BLOCK_M, RK)
        x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, rm, rk, M, K, stride_xm, stride_zm, PRO, HEAD)
        x = x_math(x, a, b, rstd, eps, offset, PRO, HEAD, BLOCK_M, BLOCK_K)
        acc = tile_dot(acc, x, w, DOT_F32)
        start += BLOCK_K
    elif PRO == 1:
        rstd = rows_rstd(x_ptr, rm, M, K, stride_xm, eps, BLOCK_M, RK)
    # x's slices a tile ahead: a slice that goes through a prologue's math before its
    # products is not a tl.dot operand Triton's pipeliner prefetches, so each iteration would
    # wait a full round trip for it (bench/fused_dot.py: 4B down-projection 17 -> 37 us with
    # the SwiGLU prologue, split-K; 183 without): the next slice's loads are issued before
    # this slice's math and products. (Past the slice: masked by K alone, wasted, harmless.)
    x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, rm, start + tl.arange(0, BLOCK_K), M, K,
                      stride_xm, stride_zm, PRO, HEAD)
    for k0 in range(start, end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_next, a_next, b_next = x_loads(x_ptr, z_ptr, nw_ptr, rm, rk + BLOCK_K, M, K,
                                         stride_xm, stride_zm, PRO, HEAD)
        xin = x_math(x, a, b, rstd, eps, offset, PRO, HEAD, BLOCK_M, BLOCK_K)
        acc = dot_tile(acc, xin, w_ptr, rn, rk, N, K, stride_wn, DOT_F32)
        x, a, b = x_next, a_next, b_next
    if PDL and PDL_LATE:
        launch_dependents()
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT > 1:
        acc, inside = split_k_sum(acc, ws_ptr, cnt_ptr, tl.program_id(0), part,
                                  rm[:, None] * N + rn[None, :], M * N, inside, SPLIT)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)  # the linear's output, rounded as the unfused one is
    if HAS_RES:  # then the residual add, rounded once more
        r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=inside, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=inside)
