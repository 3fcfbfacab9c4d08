"""The Triton kernel behind unimax.ops.fused_gemv: the GEMV of gemv_kernels.py with the small
op before it folded into how each program reads x (a prologue) and the residual add after it
folded into its store (an epilogue). Dispatch, autotuning and the kernel choice live there.

Every program reads all of x anyway (it multiplies its rows of W by the whole vector), so a
prologue costs it a few operations per element of x against BLOCK_N weight bytes per element,
and the kernel it replaces (a launch of ~1.5-2.5 us on the H200, for a few kilobytes) is gone.
"""

import triton
import triton.language as tl

from .gemv_kernels import launch_dependents, split_k_sum, tile_products, wait_for_the_kernel_before

# Prologues (the PRO constexpr; fused_gemv.PROLOGUES names them)
NONE, RMS, GATED_SILU, GATED_SIGMOID, SWIGLU, SIGMOID_GATE = 0, 1, 2, 3, 4, 5


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def row_rstd(x_ptr, row, K, stride_xm, eps, KP: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x[row]^2) + eps) in fp32: RMSNorm's factor, before the main loop (every
    program of the launch reads the same vector, from L2). With KP (K rounded up to a power of
    2) up to 8192, the whole row in one load: a loop of K / BLOCK_K dependent loads would put
    that many L2 round trips ahead of the first weight tile."""
    if KP <= 8192:
        rk = tl.arange(0, KP)
        x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        total = tl.sum(x * x, axis=0)
    else:
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
            squares += x * x
        total = tl.sum(squares, axis=0)
    return tl.rsqrt(total / K + eps)


@triton.jit
def x_loads(x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm, stride_zm, PRO: tl.constexpr,
            HEAD: tl.constexpr):
    """The loads x_math needs for x[row]'s slice rk: x, and per prologue the norm's weight,
    z, or the up half (the third: the gated norm's weight; x where a prologue needs less).
    Apart from the math so that the TMA forms can issue the next slice's loads a tile ahead."""
    mask = rk < K
    x = tl.load(x_ptr + row * stride_xm + rk, mask=mask, other=0.0)
    a = x
    b = x
    if PRO == 1:
        a = tl.load(nw_ptr + rk, mask=mask, other=0.0)
    elif PRO == 2 or PRO == 3:
        a = tl.load(z_ptr + row * stride_zm + rk, mask=mask, other=0.0)
        b = tl.load(nw_ptr + rk % HEAD)
    elif PRO == 4:
        a = tl.load(x_ptr + row * stride_xm + K + rk, mask=mask, other=0.0)
    elif PRO == 5:
        a = tl.load(z_ptr + row * stride_zm + rk, mask=mask, other=0.0)
    return x, a, b


@triton.jit
def x_math(x, a, b, rstd, eps, offset, PRO: tl.constexpr, HEAD: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """x's slice as the linear's input from x_loads' values: through the prologue, rounded to
    x's dtype where the torch forms round (the twins in unimax.norms, in the same order of
    operations). RMS: x * rstd * (offset + w). GATED_*: per head of HEAD (BLOCK_K holds whole
    heads), x * rsqrt(mean(x^2) + eps) * w * act(z). SWIGLU: silu(x[rk]) * x[K + rk] (gate,
    up). SIGMOID_GATE: x * sigmoid(z) (gated attention's output)."""
    if PRO == 1:
        x = (x.to(tl.float32) * rstd * (offset + a.to(tl.float32))).to(x.dtype)
    elif PRO == 2 or PRO == 3:
        heads = tl.reshape(x.to(tl.float32), (BLOCK_K // HEAD, HEAD))
        r = tl.rsqrt(tl.sum(heads * heads, axis=1) / HEAD + eps)
        w = tl.reshape(b.to(tl.float32), (BLOCK_K // HEAD, HEAD))
        z = tl.reshape(a.to(tl.float32), (BLOCK_K // HEAD, HEAD))
        gate = z * sigmoid(z) if PRO == 2 else sigmoid(z)
        x = tl.reshape(heads * r[:, None] * w * gate, (BLOCK_K,)).to(x.dtype)
    elif PRO == 4:
        g = x.to(tl.float32)
        silu = (g * sigmoid(g)).to(x.dtype)
        x = (silu.to(tl.float32) * a.to(tl.float32)).to(x.dtype)
    elif PRO == 5:
        gate = sigmoid(a.to(tl.float32)).to(x.dtype)
        x = (x.to(tl.float32) * gate.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def slice_products(acc, w, x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm, stride_zm,
                   rstd, eps, offset, PRO: tl.constexpr, HEAD: tl.constexpr,
                   BLOCK_K: tl.constexpr, F16: tl.constexpr):
    """x[row]'s slice rk loaded, through the prologue, times W's tile w, added to acc."""
    x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm, stride_zm, PRO, HEAD)
    return tile_products(acc, x_math(x, a, b, rstd, eps, offset, PRO, HEAD, BLOCK_K), w, F16)


@triton.jit
def conv_epilogue(y, cs_ptr, cw_ptr, row, rn, keep, C, stride_csm, W: tl.constexpr,
                  WP: tl.constexpr):
    """y (BLOCK_N,), rounded, through the causal convolution where rn < C: the window (the
    state's last W - 1 inputs, then y) dotted with cw[rn] in fp32, SiLU, rounded to y's dtype;
    the window written back as the state. Elsewhere y as it is."""
    ch = keep & (rn < C)
    s = tl.arange(0, WP)
    slot = cs_ptr + row * stride_csm + rn[:, None] * W + s[None, :]
    inside = ch[:, None] & (s[None, :] < W)
    later = tl.load(slot + 1, mask=ch[:, None] & (s[None, :] < W - 1), other=0.0)
    window = tl.where(s[None, :] == W - 1, y[:, None].to(later.dtype), later).to(y.dtype)
    weights = tl.load(cw_ptr + rn[:, None] * W + s[None, :], mask=inside, other=0.0)
    total = tl.sum(window.to(tl.float32) * weights.to(tl.float32), axis=1)
    tl.debug_barrier()  # every lane has read the old window before any lane writes the new
    tl.store(slot, window, mask=inside)
    conv = (total * sigmoid(total)).to(y.dtype)
    return tl.where(rn < C, conv, y)


@triton.jit
def beta_epilogue(y, rn, B0, NB, BETA: tl.constexpr):
    """y (BLOCK_N,), rounded, with its outputs B0 <= rn < B0 + NB (a GDN mixer's b channels)
    replaced by beta = sigmoid(b) rounded to y's dtype, doubled (and rounded) with BETA == 2:
    the mixer's write_strength (ops.decode_step), sigmoid as the block's tape kernel takes it
    (ops.short_recurrence_kernel), where a kernel of its own per layer took it before."""
    beta = sigmoid(y.to(tl.float32)).to(y.dtype)
    if BETA == 2:
        beta = (beta.to(tl.float32) * 2.0).to(y.dtype)
    return tl.where((rn >= B0) & (rn < B0 + NB), beta, y)


@triton.jit
def w_tile(w_ptr, rn, k0, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           TMA: tl.constexpr):
    """W's tile (BLOCK_N, BLOCK_K) at rows rn, columns k0.., zeros past N and K."""
    if TMA:
        w = w_ptr.load([tl.program_id(0) * BLOCK_N, k0])
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
    return w


@triton.jit
def lane_sums(acc, F16: tl.constexpr):
    """A tile's per-lane sums (acc, (BLOCK_N, BLOCK_K)) added up: (BLOCK_N,) fp32 (the FP16
    forms' x was scaled by 1/64: scaled back)."""
    y = tl.sum(acc.to(tl.float32), axis=1)
    if F16:
        y = y * 64.0
    return y


@triton.jit
def finish(y, rn, row, part, tile, N, s_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, stride_rm,
           stride_ym, cs_ptr, cw_ptr, C, stride_csm, B0, NB, HAS_SCALE: tl.constexpr,
           HAS_RES: tl.constexpr, SPLIT: tl.constexpr, CONV_W: tl.constexpr,
           CONV_WP: tl.constexpr, BETA: tl.constexpr):
    """A tile's epilogue from its sums y (lane_sums): split-K's slices added by the tile's last
    program (``tile``: its counter, row-major over (M, N tiles)), the scale, rounded, the
    convolution, beta, the residual, stored at y[row, rn]. Only SPLIT > 1 and CONV_W > 0 have
    barriers (and atomics)."""
    keep = rn < N
    if SPLIT > 1:  # (the slices added by the tile's last program: only it writes y)
        y, keep = split_k_sum(y, ws_ptr, cnt_ptr, tile, part, row * N + rn,
                              tl.num_programs(1) * N, keep, SPLIT)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rn, mask=keep, other=0.0)
    y = y.to(y_ptr.dtype.element_ty)  # the linear's output, rounded as the unfused one is
    if CONV_W > 0:
        y = conv_epilogue(y, cs_ptr, cw_ptr, row, rn, keep, C, stride_csm, CONV_W, CONV_WP)
    if BETA > 0:
        y = beta_epilogue(y, rn, B0, NB, BETA)
    if HAS_RES:  # then the residual add, rounded once more (x + linear(...) in torch)
        r = tl.load(r_ptr + row * stride_rm + rn, mask=keep, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_ym + rn, y, mask=keep)


@triton.jit
def fused_gemv_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, s_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, N, K,
                      stride_xm, stride_zm, stride_wn, stride_rm, stride_ym, eps, offset,
                      cs_ptr, cw_ptr, C, stride_csm, B0, NB,
                      PRO: tl.constexpr, HEAD: tl.constexpr, KP: tl.constexpr,
                      HAS_SCALE: tl.constexpr,
                      HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      F16: tl.constexpr, PDL: tl.constexpr = False, SPLIT: tl.constexpr = 1,
                      PDL_LATE: tl.constexpr = False, CONV_W: tl.constexpr = 0,
                      CONV_WP: tl.constexpr = 1, TMA: tl.constexpr = False,
                      STAGES: tl.constexpr = 1, BETA: tl.constexpr = 0):
    """y[row, rn] = (prologue(x[row]) . W[rn]) * s[rn] (+ r[row, rn]); K is the linear's input
    width (for SWIGLU, x holds 2K: gate then up).

    The RMS prologue's pre-pass (the row's norm) waits on an L2 round trip for x before the
    K loop; the first tile of W is loaded before it, so that the DRAM latency of W's first
    tile, the longest wait of a short GEMV's chain, overlaps it (Nsight Compute:
    the 4B FP8 GEMVs with an RMS prologue took 0.9-1.9 us longer than without).
    The same tiles and sums in the same order as the loop's.

    ``PDL`` (launched with programmatic dependent launch, compute capability 9+): the kernel
    lets the next one start at once, and itself reads its first tile of W (which no kernel
    writes) before waiting for the kernel before it; x, z, the residual and y only after.
    Between two such GEMVs the next one's ramp overlaps this one's tail. The same tiles and
    sums in the same order as without. ``PDL_LATE``: the next kernel may start only once
    every program of this one is past its K loop (in its epilogue), not from the start.

    ``SPLIT`` > 1 (split-K, for the few-row, K-long linears: more programs in flight): program
    (n, row, s) sums its slice s of K (whole BLOCK_K tiles) and stores the partial sums in the
    workspace ws (SPLIT, M, N, fp32); the last of a tile's SPLIT programs to finish (a counter
    per tile, cnt, which it sets back to 0) adds them in split order and applies the epilogue
    (gemv_kernels.split_k_sum): one launch, where a split-K GEMV with a reduce kernel after it
    lost (bench/RESULTS.md).

    ``TMA`` (compute capability 9+; w_ptr is then a tensor descriptor of W over (N, K) with
    block (BLOCK_N, BLOCK_K), which fills zeros past N and K as the masks do): W's tiles come
    through the Tensor Memory Accelerator, which Triton's loop pipeliner (STAGES) issues
    STAGES - 1 tiles ahead into shared memory, and x's slices (with z, the norm's weight, the
    up half) are loaded a tile ahead into registers: with W's wait gone, each iteration's
    L2 round trip for x would otherwise be the chain (W alone pipelined,
    the TMA forms ran 1.04-2.9x slower than the plain ones). A plain tl.load that feeds no
    tl.dot is never pipelined (checked in the compiled TTGIR: no async copies at any
    num_stages), so each program of the plain forms waits out one DRAM round trip per tile:
    the short GEMVs' fixed cost (bench/RESULTS.md, Nsight Compute).

    ``CONV_W`` > 0 (a GDN mixer's in-projection in a decode step): outputs rn < C are the
    short convolution's channels. Each is the last input of its causal window, which the
    program that computes it owns: it rolls the window in the conv state cs (M, >= C, CONV_W,
    contiguous; weights cw (C, CONV_W)) and stores SiLU(window . cw[rn]) in place of the
    projection, which removes the convolution's own launch (ops.conv.causal_conv1d_step's
    arithmetic: the window in x's dtype, the products and sum in fp32, SiLU, then rounded).

    ``BETA`` > 0 (with the convolution: the in-projection of the verifier's one-token
    forwards): outputs B0 <= rn < B0 + NB are the mixer's b channels, stored as beta =
    sigmoid(b) rounded (``beta_epilogue``; doubled with BETA == 2), the mixer's own rounding,
    which removes the sigmoid's launch per layer (``ops.in_proj_conv``)."""
    row = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(2)
    span = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K  # each slice whole tiles; the last may be short
    start = part * span
    end = tl.minimum(start + span, K)
    rstd = 1.0
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16 if F16 else tl.float32)
    if PDL or PRO == 1:  # the first tile of W, loaded before anything that waits
        if PDL and not PDL_LATE:
            launch_dependents()
        rk = start + tl.arange(0, BLOCK_K)
        w = w_tile(w_ptr, rn, start, N, K, stride_wn, BLOCK_N, BLOCK_K, TMA)
        if PDL:
            wait_for_the_kernel_before()
        if PRO == 1:  # (the norm's pre-pass over x now overlaps that load)
            rstd = row_rstd(x_ptr, row, K, stride_xm, eps, KP, BLOCK_K)
        acc = slice_products(acc, w, x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm, stride_zm,
                             rstd, eps, offset, PRO, HEAD, BLOCK_K, F16)
        start += BLOCK_K
    if TMA:  # W's tiles pipelined by Triton, x's loads issued here a tile ahead of their use
        rk = start + tl.arange(0, BLOCK_K)
        x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm, stride_zm, PRO, HEAD)
        for k0 in tl.range(start, end, BLOCK_K, num_stages=STAGES):
            w = w_tile(w_ptr, rn, k0, N, K, stride_wn, BLOCK_N, BLOCK_K, TMA)
            rk = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
            x_next, a_next, b_next = x_loads(x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm,
                                             stride_zm, PRO, HEAD)
            acc = tile_products(acc, x_math(x, a, b, rstd, eps, offset, PRO, HEAD, BLOCK_K), w,
                                F16)
            x, a, b = x_next, a_next, b_next
    else:
        for k0 in range(start, end, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = w_tile(w_ptr, rn, k0, N, K, stride_wn, BLOCK_N, BLOCK_K, TMA)
            acc = slice_products(acc, w, x_ptr, z_ptr, nw_ptr, row, rk, K, stride_xm,
                                 stride_zm, rstd, eps, offset, PRO, HEAD, BLOCK_K, F16)
    if PDL and PDL_LATE:
        launch_dependents()
    y = lane_sums(acc, F16)
    finish(y, rn, row, part, row * tl.num_programs(0) + tl.program_id(0), N,
           s_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, stride_rm, stride_ym, cs_ptr, cw_ptr, C,
           stride_csm, B0, NB, HAS_SCALE, HAS_RES, SPLIT, CONV_W, CONV_WP, BETA)
