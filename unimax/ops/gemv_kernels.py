"""The Triton kernels behind unimax.ops.gemv (imported by it lazily: Triton is needed only for
CUDA work and the interpreter tests). Dispatch, autotuning and the kernel choice live there."""

import triton
import triton.language as tl


@triton.jit
def row_tile(acc, x_ptr, w, row, rk, K, stride_xm, F16: tl.constexpr):
    """acc + W's tile (BLOCK_N, BLOCK_K) times x[row]'s slice rk, elementwise per lane."""
    x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0)
    return tile_products(acc, x, w, F16)


@triton.jit
def tile_products(acc, x, w, F16: tl.constexpr):
    """acc + W's tile (BLOCK_N, BLOCK_K) times the x slice (BLOCK_K,), elementwise per lane
    (also the fused GEMVs' body, fused_gemv_kernels.py, whose x slice comes from a prologue)."""
    if F16:
        x16 = tl.clamp(x.to(tl.float32) * 0.015625, -65504.0, 65504.0)
        acc += w.to(tl.float16) * x16.to(tl.float16)[None, :]
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def row_sums(x_ptr, w_ptr, row, rn, N, K, stride_xm, stride_wn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F16: tl.constexpr):
    """x[row] . W[rn] (fp32, (BLOCK_N,)), streaming W's rows once.

    ``F16`` ("rows16", FP8 weights): products and the per-lane running sums in FP16, x scaled
    by 1/64 first (the caller multiplies the sums back by 64); see gemv._gemv_kernel."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16 if F16 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc = row_tile(acc, x_ptr, w, row, rk, K, stride_xm, F16)
    return tl.sum(acc.to(tl.float32), axis=1)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                F16: tl.constexpr):
    row = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = row_sums(x_ptr, w_ptr, row, rn, N, K, stride_xm, stride_wn, BLOCK_N, BLOCK_K, F16)
    if F16:
        y = y * 64.0
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def launch_dependents():
    """PTX griddepcontrol.launch_dependents: the kernel after this one, if launched with
    programmatic dependent launch, may start now (on SMs this kernel's programs free up); it
    still waits (below) for this kernel to finish before reading what it writes."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_the_kernel_before():
    """PTX griddepcontrol.wait: with programmatic dependent launch the kernel before may still
    be running; once this returns it has finished and everything it wrote is visible."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def split_k_sum(part_sum, ws_ptr, cnt_ptr, tile, part, slot, size, inside,
                SPLIT: tl.constexpr):
    """Split-K in one launch: each of a tile's SPLIT programs stores its partial sums (fp32,
    at ``slot`` of slice ``part``'s ``size`` in the workspace ws) and counts itself in at the
    tile's counter; the last to arrive adds the SPLIT slices in slice order (the same sums
    whichever program came last) and sets the counter back to 0 for the next launch (graph
    replays). Returns (the total, where to store it: ``inside`` in the last program only).
    The fused GEMVs' split forms (fused_gemv_kernels.py) and "dotsplit" (dot_kernel)."""
    tl.store(ws_ptr + part * size + slot, part_sum, mask=inside)
    tl.debug_barrier()  # every thread's partial stored before the counter moves
    last = tl.atomic_add(cnt_ptr + tile, 1) == SPLIT - 1  # (acq_rel, device scope)
    tl.debug_barrier()
    inside = inside & last  # the others are done: only the last program writes
    total = tl.zeros_like(part_sum)
    for s in range(SPLIT):  # in slice order, whichever program came last
        total += tl.load(ws_ptr + s * size + slot, mask=inside, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(cnt_ptr + tile, 0, mask=last)  # ready for the next launch (replays)
    return total, inside


@triton.jit
def k_slice(K, part, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[start, end) of K for slice ``part`` of SPLIT (split-K: whole BLOCK_K tiles each, the
    last may be short, or empty); all of K where SPLIT is 1."""
    start = part * 0
    end = K
    if SPLIT > 1:
        span = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
        start = part * span
        end = tl.minimum(start + span, K)
    return start, end


@triton.jit
def dot_w_tile(w_ptr, rn, rk, N, K, stride_wn):
    return tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                   mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)


@triton.jit
def dot_x_tile(x_ptr, rm, rk, M, K, stride_xm):
    return tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                   mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)


@triton.jit
def dot_tile(acc, x, w_ptr, rn, rk, N, K, stride_wn, DOT_F32: tl.constexpr):
    """acc + x (BLOCK_M, BLOCK_K) @ W[rn, rk]^T on the tensor cores."""
    return tile_dot(acc, x, dot_w_tile(w_ptr, rn, rk, N, K, stride_wn), DOT_F32)


@triton.jit
def tile_dot(acc, x, w, DOT_F32: tl.constexpr):
    """acc + x (BLOCK_M, BLOCK_K) @ w^T, w a tile of W (BLOCK_N, BLOCK_K)."""
    # FP8 values are exact in BF16: the product is the weights' own, accumulated fp32.
    # (Triton's CPU interpreter multiplies BF16 dots wrongly: it takes fp32 there.)
    if DOT_F32:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                            input_precision="ieee")
    return acc + tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit
def swiglu_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up as the eager torch forms round it (gate and up already in ``dtype``'s
    values, given in fp32): silu rounded to ``dtype``, then the product; in fp32."""
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return act * up


@triton.jit
def dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
               stride_ym, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
               SPLIT: tl.constexpr = 1, SWIGLU: tl.constexpr = False,
               PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
    """y = x @ W^T (* s): all M <= BLOCK_M rows of x against a tile of W's rows per program.

    ``SPLIT`` > 1 (split-K, "dotsplit": the verifier's K-long, narrow linears, whose N / BLOCK_N
    tiles are too few programs to keep the H200's memory busy): program (n, s) sums its slice
    s of K (whole BLOCK_K tiles); ``split_k_sum`` adds the slices in the tile's last program
    (workspace ws (SPLIT, M, N) fp32, a counter per tile in cnt): one launch, where cuBLAS runs
    a reduce kernel after its split-K GEMM.

    ``SWIGLU`` (SPLIT 1; ops.gemv_swiglu): W is an MLP's [gate; up] (2N, K) and y (M, N) is
    silu(x @ gate^T) * (x @ up^T): each program takes the same rows of both halves, so the
    activation is its epilogue, not a kernel of its own. Each product is rounded to y's dtype
    first, as the GEMM's output would be, then ``swiglu_rounded``.

    ``PDL`` (launched with programmatic dependent launch, compute capability 9+; the verifier's
    blocks where its timing chose it, unimax.verifier.Verifier.choose_pdl): the program loads
    its first tile of W (weights: nothing before writes them) before it waits for the kernel
    before, and lets the next kernel launch at its start (``PDL_LATE``: at the end of its
    loop), as the fused GEMVs do (fused_gemv_kernels.fused_gemv_kernel). The same sums in the
    same order as without."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    start, end = k_slice(K, part, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL:  # the first tile taken out of the loop, its W loaded before the wait (a split's
        # empty last slice, past K: masked to zeros, as the loop would add nothing)
        if not PDL_LATE:
            launch_dependents()
        rk = start + tl.arange(0, BLOCK_K)
        w = dot_w_tile(w_ptr, rn, rk, N, K, stride_wn)
        w_up = w
        if SWIGLU:
            w_up = dot_w_tile(w_ptr + N * stride_wn, rn, rk, N, K, stride_wn)
        wait_for_the_kernel_before()
        x = dot_x_tile(x_ptr, rm, rk, M, K, stride_xm)
        acc = tile_dot(acc, x, w, DOT_F32)
        if SWIGLU:
            acc_up = tile_dot(acc_up, x, w_up, DOT_F32)
        start += BLOCK_K
    for k0 in range(start, end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = dot_x_tile(x_ptr, rm, rk, M, K, stride_xm)
        acc = dot_tile(acc, x, w_ptr, rn, rk, N, K, stride_wn, DOT_F32)
        if SWIGLU:  # (the up rows: N rows further on)
            acc_up = dot_tile(acc_up, x, w_ptr + N * stride_wn, rn, rk, N, K, stride_wn,
                              DOT_F32)
    if PDL and PDL_LATE:
        launch_dependents()
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT > 1:
        tl.static_assert(not SWIGLU, "SWIGLU takes SPLIT 1")
        acc, inside = split_k_sum(acc, ws_ptr, cnt_ptr, tl.program_id(0), part,
                                  rm[:, None] * N + rn[None, :], M * N, inside, SPLIT)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if SWIGLU:
            acc_up = acc_up * tl.load(s_ptr + N + rn, mask=rn < N, other=0.0)[None, :]
    if SWIGLU:
        dtype = y_ptr.dtype.element_ty
        acc = swiglu_rounded(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32),
                             dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def swiglu_kernel(gu_ptr, y_ptr, N, stride_gm, stride_ym, BLOCK: tl.constexpr):
    """y[m] = silu(gu[m, :N]) * gu[m, N:] (``swiglu_rounded``): the activation after a cuBLAS
    gate-up product, one launch, as inductor's fused kernel was (ops.gemv_swiglu)."""
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(gu_ptr + m * stride_gm + rn, mask=rn < N, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + m * stride_gm + N + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = swiglu_rounded(gate, up, y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)
