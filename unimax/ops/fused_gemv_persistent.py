"""The fused GEMV's persistent TMA forms ("tmap", "tmap16", "tmapsplit", "tmapsplit16"; see
unimax.ops.fused_gemv.PERSIST_FORMS): fused_gemv_kernel's arithmetic, tile for tile, with a
grid of a few programs per SM that stream every tile of W between them in one pipelined loop.

Why: a short GEMV's time is t0 + bytes / ~4.2 TB/s with t0 ~4-5.5 us on the H200 (bench/
RESULTS.md, fifteenth session), and inside one program of the other forms each K loop starts
its own chain of DRAM round trips (the TMA forms pipeline within a program's K loop only, and
a program's first tile still waits a full trip), then the launch's last wave of short programs
leaves the SMs idle. Here a program's loop runs over (its units, K tiles) as one sequence, so
Triton's pipeliner keeps STAGES - 1 tiles of W in flight across unit boundaries, and x's slices
(with z, the norm's weight, the up half) are loaded one iteration ahead; the RMS prologue's
norm is computed once per program, not once per tile. A unit is one output tile (with split-K,
one of its SPLIT slices of K): unit u is tile u // SPLIT, slice u % SPLIT, and program p takes
units p, p + P, p + 2P, ...; each unit's epilogue (fused_gemv_kernels.finish: scale,
rounding, residual) runs when its last K tile is in, so the sums are the other forms' sums in
the same order. The epilogues with barriers (split-K's in-launch sum, the folded convolution)
run after the loop instead, from the sums each unit stored in the workspace: Triton's
pipeliner keeps no tile in flight across a barrier.
"""

import triton
import triton.language as tl

from .fused_gemv_kernels import finish, lane_sums, row_rstd, x_loads, x_math
from .gemv_kernels import tile_products


@triton.jit
def fused_gemv_persistent_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, s_ptr, r_ptr, y_ptr, ws_ptr,
                                 cnt_ptr, N, K, stride_xm, stride_zm, stride_wn, stride_rm,
                                 stride_ym, eps, offset, cs_ptr, cw_ptr, C, stride_csm,
                                 PRO: tl.constexpr, HEAD: tl.constexpr, KP: tl.constexpr,
                                 HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 F16: tl.constexpr, SPLIT: tl.constexpr = 1,
                                 CONV_W: tl.constexpr = 0, CONV_WP: tl.constexpr = 1,
                                 STAGES: tl.constexpr = 4):
    """fused_gemv_kernel's y for row program_id(1), W through the tensor descriptor w_ptr
    (block (BLOCK_N, BLOCK_K), zeros past N and K), by num_programs(0) programs that take the
    units in turn (grid: at most as many programs as units)."""
    row = tl.program_id(1)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, SPLIT * BLOCK_K)  # per slice: whole tiles, the last slice may be short
    span = k_tiles * BLOCK_K
    mine = tl.cdiv(tiles * SPLIT - pid, programs)
    rstd = 1.0
    if PRO == 1:
        rstd = row_rstd(x_ptr, row, K, stride_xm, eps, KP, BLOCK_K)
    lanes = tl.arange(0, BLOCK_K)
    x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, row, (pid % SPLIT) * span + lanes, K, stride_xm,
                      stride_zm, PRO, HEAD)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16 if F16 else tl.float32)
    for i in tl.range(0, mine * k_tiles, num_stages=STAGES):
        step = i // k_tiles
        kk = i - step * k_tiles
        unit = pid + step * programs
        tile = unit // SPLIT
        part = unit - tile * SPLIT
        w = w_ptr.load([tile * BLOCK_N, part * span + kk * BLOCK_K])
        # the next iteration's slice of x (the next unit's first after this unit's last;
        # past the program's last unit, a slice nobody uses)
        following = (i + 1) // k_tiles
        next_k = (((pid + following * programs) % SPLIT) * span
                  + (i + 1 - following * k_tiles) * BLOCK_K)
        x_next, a_next, b_next = x_loads(x_ptr, z_ptr, nw_ptr, row, next_k + lanes, K,
                                         stride_xm, stride_zm, PRO, HEAD)
        acc = tile_products(acc, x_math(x, a, b, rstd, eps, offset, PRO, HEAD, BLOCK_K), w,
                            F16)
        x, a, b = x_next, a_next, b_next
        if kk == k_tiles - 1:  # the unit's last tile: its epilogue, then the next unit's sums
            rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            y = lane_sums(acc, F16)
            if SPLIT == 1 and CONV_W == 0:
                finish(y, rn, row, part, row * tiles + tile, N, s_ptr, r_ptr, y_ptr, ws_ptr,
                       cnt_ptr, stride_rm, stride_ym, cs_ptr, cw_ptr, C, stride_csm,
                       HAS_SCALE, HAS_RES, SPLIT, CONV_W, CONV_WP)
            else:  # (kept for after the loop: a barrier in it stops the pipelining)
                tl.store(ws_ptr + (part * tl.num_programs(1) + row) * N + rn, y, mask=rn < N)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16 if F16 else tl.float32)
    if SPLIT > 1 or CONV_W > 0:
        # the epilogues with barriers (split-K's in-launch sum: atomics; the convolution's
        # window rolled in place), one per unit of this program's, from the sums it stored:
        # in the loop, Triton's pipeliner issues no tile ahead across a barrier (the loop
        # compiled for sm_90 had one TMA copy in flight where it has STAGES - 1 without)
        tl.debug_barrier()
        for step in range(mine):
            unit = pid + step * programs
            tile = unit // SPLIT
            part = unit - tile * SPLIT
            rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            y = tl.load(ws_ptr + (part * tl.num_programs(1) + row) * N + rn, mask=rn < N,
                        other=0.0)
            finish(y, rn, row, part, row * tiles + tile, N, s_ptr, r_ptr, y_ptr, ws_ptr,
                   cnt_ptr, stride_rm, stride_ym, cs_ptr, cw_ptr, C, stride_csm, HAS_SCALE,
                   HAS_RES, SPLIT, CONV_W, CONV_WP)
