"""The Triton kernel behind unimax.ops.fused_mlp: a decode step's whole SwiGLU MLP, the residual
add included, in one launch. Dispatch, the twin and the timed choice live there.

Program j owns BLOCK_I of the intermediate channels. It computes their gate and up rows over
RMSNorm(x) (the fused GEMV's "rms" prologue: fused_gemv_kernels), rounds them, takes
silu(gate) * up (the "swiglu" prologue's rounding), and multiplies those BLOCK_I values by the
down-projection's columns of the same channels: a split-K GEMV of the down-projection whose
slices are the programs' channels, so the hidden activation never leaves the program. The
partial sums go into an fp32 workspace with atomic adds; the last program to arrive (a counter,
as split-K's: gemv_kernels.split_k_sum) scales them, rounds, adds the residual, stores y and sets
the workspace and the counter back to zero for the next launch.
"""

import triton
import triton.language as tl

from .fused_gemv_kernels import lane_sums, row_rstd, x_loads, x_math
from .gemv_kernels import launch_dependents, tile_products, wait_for_the_kernel_before

RMS = tl.constexpr(1)  # fused_gemv_kernels' prologue numbers
SWIGLU = tl.constexpr(4)


@triton.jit
def gate_up_tiles(w_ptr, ri, k0, I, K, stride_wn, BLOCK_I: tl.constexpr,
                  BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """The gate rows ri and the up rows I + ri of [gate; up] (2I, K), columns k0..: two
    (BLOCK_I, BLOCK_K) tiles. Rows past I are read as zeros (plain loads) or as whatever the
    descriptor holds there (TMA: up rows, or zeros past 2I); either way their products are
    dropped (the hidden values of channels past I are set to zero)."""
    if TMA:
        i0 = tl.program_id(0) * BLOCK_I
        gate = w_ptr.load([i0, k0])
        up = w_ptr.load([I + i0, k0])
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        inside = (ri[:, None] < I) & (rk[None, :] < K)
        gate = tl.load(w_ptr + ri[:, None] * stride_wn + rk[None, :], mask=inside, other=0.0)
        up = tl.load(w_ptr + (I + ri)[:, None] * stride_wn + rk[None, :], mask=inside,
                     other=0.0)
    return gate, up


@triton.jit
def down_tile(w_ptr, rn, ri, n0, N, I, stride_dn, BLOCK_I: tl.constexpr, TMA: tl.constexpr):
    """The down-projection's (N, I) tile at rows rn (from n0), columns ri: (BLOCK_N, BLOCK_I),
    zeros past N and I."""
    if TMA:
        w = w_ptr.load([n0, tl.program_id(0) * BLOCK_I])
    else:
        w = tl.load(w_ptr + rn[:, None] * stride_dn + ri[None, :],
                    mask=(rn[:, None] < N) & (ri[None, :] < I), other=0.0)
    return w


@triton.jit
def down_partials(w, hidden, F16: tl.constexpr, DOWN_T: tl.constexpr):
    """W's (BLOCK_N, BLOCK_I) tile times the program's hidden values, summed over its channels:
    (BLOCK_N,) fp32. ``DOWN_T``: the tile transposed first and summed over axis 0, which
    gives the sums a layout whose atomics Triton issues as vectors (fewer L2 operations)."""
    if DOWN_T:
        if F16:
            h = tl.clamp(hidden.to(tl.float32) * 0.015625, -65504.0, 65504.0).to(tl.float16)
            part = tl.sum((tl.trans(w).to(tl.float16) * h[:, None]).to(tl.float32), axis=0)
            part = part * 64.0
        else:
            part = tl.sum(tl.trans(w).to(tl.float32) * hidden.to(tl.float32)[:, None], axis=0)
    else:
        part = lane_sums(tile_products(tl.zeros(w.shape, dtype=tl.float16 if F16 else tl.float32),
                                       hidden, w, F16), F16)
    return part


@triton.jit
def gate_up_products(acc_g, acc_u, gate, up, x_ptr, nw_ptr, row, rk, N, stride_xm, rstd, eps,
                     offset, BLOCK_K: tl.constexpr, F16: tl.constexpr):
    """x[row]'s slice rk through the RMS prologue, times the gate and up tiles, added."""
    x, a, b = x_loads(x_ptr, x_ptr, nw_ptr, row, rk, N, stride_xm, 0, RMS, 1)
    x = x_math(x, a, b, rstd, eps, offset, RMS, 1, BLOCK_K)
    return tile_products(acc_g, x, gate, F16), tile_products(acc_u, x, up, F16)


@triton.jit
def fused_mlp_kernel(x_ptr, nw_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, y_ptr, acc_ptr, cnt_ptr,
                     N, I, stride_xm, stride_gn, stride_dn, stride_ym, eps, offset,
                     KP: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_I: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, F16: tl.constexpr,
                     TMA: tl.constexpr = False, STAGES: tl.constexpr = 1,
                     PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
                     DOWN_T: tl.constexpr = False, ATOMICS: tl.constexpr = True):
    """y[row] = x[row] + down(silu(gate) * up), [gate; up] = gate_up(RMSNorm(x[row])); N is
    the hidden size, I the intermediate one. The workspace acc (M, N) fp32 and the counters
    cnt (M,) are zero between launches.

    The rounding is the two fused GEMVs' (ops.fused_gemv: "rms" into gate_up, then "swiglu"
    with the residual into down): gate and up scaled and rounded, silu(gate) rounded, the
    product rounded; down's sums scaled and rounded, then the residual added and rounded. The
    down-projection's sums add the programs' partials in the order their atomics land, so its
    last bit can differ from run to run (a draft's tokens are checked by the exact model: at
    most acceptance moves).

    ``TMA`` (compute capability 9+; wgu_ptr and wd_ptr are then tensor descriptors over
    (2I, N) with block (BLOCK_I, BLOCK_K) and over (N, I) with block (BLOCK_N, BLOCK_I)):
    the tiles of both loops come through the Tensor Memory Accelerator, Triton's pipeliner
    issuing STAGES - 1 ahead, x's slices loaded a tile ahead (as fused_gemv_kernel's TMA
    forms). ``PDL`` as there: the first gate and up tiles are read before the wait."""
    row = tl.program_id(1)
    ri = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    adt = tl.float16 if F16 else tl.float32
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=adt)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=adt)
    if PDL and not PDL_LATE:
        launch_dependents()
    gate, up = gate_up_tiles(wgu_ptr, ri, 0, I, N, stride_gn, BLOCK_I, BLOCK_K, TMA)
    if PDL:  # (W needs nothing from the kernel before; x does)
        wait_for_the_kernel_before()
    rstd = row_rstd(x_ptr, row, N, stride_xm, eps, KP, BLOCK_K)
    rk = tl.arange(0, BLOCK_K)
    acc_g, acc_u = gate_up_products(acc_g, acc_u, gate, up, x_ptr, nw_ptr, row, rk, N,
                                    stride_xm, rstd, eps, offset, BLOCK_K, F16)
    if TMA:
        rk = BLOCK_K + tl.arange(0, BLOCK_K)
        x, a, b = x_loads(x_ptr, x_ptr, nw_ptr, row, rk, N, stride_xm, 0, RMS, 1)
        for k0 in tl.range(BLOCK_K, N, BLOCK_K, num_stages=STAGES):
            gate, up = gate_up_tiles(wgu_ptr, ri, k0, I, N, stride_gn, BLOCK_I, BLOCK_K, TMA)
            rk = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
            x_next, a_next, b_next = x_loads(x_ptr, x_ptr, nw_ptr, row, rk, N, stride_xm, 0,
                                             RMS, 1)
            xs = x_math(x, a, b, rstd, eps, offset, RMS, 1, BLOCK_K)
            acc_g = tile_products(acc_g, xs, gate, F16)
            acc_u = tile_products(acc_u, xs, up, F16)
            x, a, b = x_next, a_next, b_next
    else:
        for k0 in range(BLOCK_K, N, BLOCK_K):
            gate, up = gate_up_tiles(wgu_ptr, ri, k0, I, N, stride_gn, BLOCK_I, BLOCK_K, TMA)
            acc_g, acc_u = gate_up_products(acc_g, acc_u, gate, up, x_ptr, nw_ptr, row,
                                            k0 + tl.arange(0, BLOCK_K), N, stride_xm, rstd,
                                            eps, offset, BLOCK_K, F16)
    g = lane_sums(acc_g, F16)
    u = lane_sums(acc_u, F16)
    if HAS_SCALE:
        g = g * tl.load(sgu_ptr + ri, mask=ri < I, other=0.0)
        u = u * tl.load(sgu_ptr + I + ri, mask=ri < I, other=0.0)
    dtype = y_ptr.dtype.element_ty
    hidden = x_math(g.to(dtype), u.to(dtype), u.to(dtype), 1.0, eps, offset, SWIGLU, 1, BLOCK_I)
    hidden = tl.where(ri < I, hidden, 0.0).to(dtype)
    # the down-projection over this program's channels: partial sums for every output
    if TMA:
        for n0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            rn = n0 + tl.arange(0, BLOCK_N)
            w = down_tile(wd_ptr, rn, ri, n0, N, I, stride_dn, BLOCK_I, TMA)
            part = down_partials(w, hidden, F16, DOWN_T)
            if ATOMICS:  # (off: plain stores, a bench's measure of what atomics cost; y wrong)
                tl.atomic_add(acc_ptr + row * N + rn, part, mask=rn < N, sem="relaxed")
            else:
                tl.store(acc_ptr + row * N + rn, part, mask=rn < N)
    else:
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            w = down_tile(wd_ptr, rn, ri, n0, N, I, stride_dn, BLOCK_I, TMA)
            part = down_partials(w, hidden, F16, DOWN_T)
            if ATOMICS:  # (off: plain stores, a bench's measure of what atomics cost; y wrong)
                tl.atomic_add(acc_ptr + row * N + rn, part, mask=rn < N, sem="relaxed")
            else:
                tl.store(acc_ptr + row * N + rn, part, mask=rn < N)
    if PDL and PDL_LATE:
        launch_dependents()
    tl.debug_barrier()  # every thread's adds issued before the counter moves
    last = tl.atomic_add(cnt_ptr + row, 1) == tl.num_programs(0) - 1  # (acq_rel, device scope)
    tl.debug_barrier()
    if last:  # the others are done: the sums are whole. The row at once (KP wide): a loop
        # of dependent L2 round trips here would stand alone at the end of the launch
        rn = tl.arange(0, KP)
        inside = rn < N
        total = tl.load(acc_ptr + row * N + rn, mask=inside, other=0.0, cache_modifier=".cg")
        if HAS_SCALE:
            total = total * tl.load(sd_ptr + rn, mask=inside, other=0.0)
        r = tl.load(x_ptr + row * stride_xm + rn, mask=inside, other=0.0)
        y = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(y_ptr + row * stride_ym + rn, y, mask=inside)
        tl.store(acc_ptr + row * N + rn, tl.zeros((KP,), dtype=tl.float32), mask=inside)
        tl.atomic_xchg(cnt_ptr + row, 0)  # ready for the next launch (graph replays)
