"""The Triton kernels behind unimax.ops.int4_gemv and unimax.ops.int4_fused (imported by them
lazily). Their dequantizer is inline PTX, which Triton's CPU interpreter does not run: with
``PTX`` off (the interpreter tests) ``nibbles`` takes plain integer arithmetic to the same
values, so the rest of each kernel is checked on the CPU too. Dispatch and the tile choice live
in those modules; the layout is unimax.int4's."""

import triton
import triton.language as tl

from .fused_gemv_kernels import finish, row_rstd, x_loads, x_math
from .gemv_kernels import launch_dependents, wait_for_the_kernel_before


@triton.jit
def nibbles_to_f16(b):
    """(q of the low nibbles, q of the high ones) in FP16 from uint8 bytes, four bytes (eight
    weights) in ten instructions, in PTX (the AWQ / Marlin dequantizer, spread by byte so that
    each output keeps its byte's position): PRMT puts bytes 0, 1 (and 2, 3) in the low bytes
    of two half-words; LOP3 (a & mask) | 0x6400 makes 1024 + low nibble and 1024 + 16 x high
    nibble as half2; one sub.f16x2 (- 1032) and one fma.rn.f16x2 (x 1/16 - 72) leave q, all
    exact. Outputs $0 $1 (low nibbles of bytes 0-1, 2-3) and $2 $3 (high), input $4."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, t, u, m, k16, k72;
        mov.b32 z, 0;
        prmt.b32 t, $4, z, 0x4140;
        prmt.b32 u, $4, z, 0x4342;
        lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, u, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, t, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, u, 0x00F000F0, 0x64006400, 0xEA;
        mov.b32 m, 0x64086408;
        mov.b32 k16, 0x2C002C00;
        mov.b32 k72, 0xD480D480;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        fma.rn.f16x2 $2, $2, k16, k72;
        fma.rn.f16x2 $3, $3, k16, k72;
        }""",
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True,
        pack=4)


@triton.jit
def nibbles(b, PTX: tl.constexpr):
    """nibbles_to_f16, or with PTX off the same values by integer arithmetic (exact)."""
    if PTX:
        lo, hi = nibbles_to_f16(b)
    else:
        u = b.to(tl.int32)
        lo = ((u & 15) - 8).to(tl.float16)
        hi = ((u >> 4) - 8).to(tl.float16)
    return lo, hi


@triton.jit
def w_bytes(w_ptr, s_ptr, rn, k0, N, stride_wn, stride_sn, GROUP: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The tile of W at columns k0..k0 + BLOCK_K: its bytes (BLOCK_N, groups, GROUP / 2), their
    groups' scales (BLOCK_N, groups) and the byte columns rb (groups, GROUP / 2)."""
    HALF: tl.constexpr = GROUP // 2
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # (GROUPS,)
    rb = g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # packed byte columns (GROUPS, HALF)
    b = tl.load(w_ptr + rn[:, None, None] * stride_wn + rb[None, :, :],
                mask=rn[:, None, None] < N, other=136)
    scale = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=rn[:, None] < N,
                    other=0.0)
    return b, scale, rb


@triton.jit
def half2_tile(acc, b, scale, rb, x_ptr, K, PRE_X: tl.constexpr, PTX: tl.constexpr):
    """acc plus a tile's scaled products (w_bytes' b, scale, rb) with x's columns."""
    lo, hi = nibbles(b, PTX)
    if PRE_X:
        x_even = tl.load(x_ptr + rb)
        x_odd = tl.load(x_ptr + K // 2 + rb)
    else:
        x_even = (tl.load(x_ptr + 2 * rb).to(tl.float32) * 0.015625).to(tl.float16)
        x_odd = (tl.load(x_ptr + 2 * rb + 1).to(tl.float32) * 0.015625).to(tl.float16)
    return acc + (lo * x_even[None, :, :] + hi * x_odd[None, :, :]) * scale[:, :, None]


@triton.jit
def half2_sums(x_ptr, w_ptr, s_ptr, rn, N, K, stride_wn, stride_sn, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_X: tl.constexpr,
               PTX: tl.constexpr, PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
    """Rows rn of dequant(W) . x in fp32 (BLOCK_N,): see int4_gemv_kernel. ``PDL``
    (launched with programmatic dependent launch): the next kernel may launch at once (or,
    ``PDL_LATE``, once past the K loop), and the first tile of W, which no kernel writes, is
    read before waiting for the kernel before (which writes x); the same sums in the same
    order as without."""
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP, GROUP // 2), dtype=tl.float16)
    start = 0
    if PDL:
        if not PDL_LATE:
            launch_dependents()
        b, scale, rb = w_bytes(w_ptr, s_ptr, rn, 0, N, stride_wn, stride_sn, GROUP, BLOCK_K)
        wait_for_the_kernel_before()
        acc = half2_tile(acc, b, scale, rb, x_ptr, K, PRE_X, PTX)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        b, scale, rb = w_bytes(w_ptr, s_ptr, rn, k0, N, stride_wn, stride_sn, GROUP, BLOCK_K)
        acc = half2_tile(acc, b, scale, rb, x_ptr, K, PRE_X, PTX)
    if PDL and PDL_LATE:
        launch_dependents()
    return tl.sum(tl.sum(acc.to(tl.float32), axis=2), axis=1) * 64.0


@triton.jit
def int4_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRE_X: tl.constexpr = True, PTX: tl.constexpr = True):
    """y (1, N) = x (1, K) @ dequant(W).T with packed FP16 arithmetic: nibbles_to_f16, then
    per-lane FP16 running sums of scaled products over a (BLOCK_N, groups, GROUP / 2) tile, the
    group's scale (FP16) a broadcast, one fp32 reduction at the end, times 64. K a multiple of
    BLOCK_K (no masks along K), BLOCK_K of GROUP.

    ``PRE_X`` (the draft's form): x comes ready (int4_gemv.prepare_x: FP16, x / 64, the even
    columns then the odd ones, each contiguous), two vector loads per 16 weights. Off, the
    kernel reads x (1, K) and makes it so itself: each thread holds its own rows, so that work
    is paid per weight, and ncu counted 5.7 instructions a weight against 2.9 ready, 0.52 of
    the H200's copy bandwidth against 0.82 (bench/int4_gemv.py compares the two)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = half2_sums(x_ptr, w_ptr, s_ptr, rn, N, K, stride_wn, stride_sn, GROUP, BLOCK_N,
                   BLOCK_K, PRE_X, PTX)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def int4_ready_kernel(x_ptr, z_ptr, nw_ptr, ready_ptr, K, eps, offset, PRO: tl.constexpr,
                      HEAD: tl.constexpr, KP: tl.constexpr, PRE_BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """The int4 draft linear's prologue, x (1, K) -> ready (K FP16: prologue(x) / 64, the even
    columns then the odd ones, as ops.int4_gemv.prepare_x), PRE_BLOCK columns a program (whole
    heads for a gated prologue), each program taking RMSNorm's factor over the whole row itself
    (one load: every program reads the same vector, from L2). The same prologues PRO, x_loads /
    x_math, as the FP8 draft's fused GEMVs (fused_gemv_kernels).

    A launch of its own, not run inside the GEMV: there every program ran it over all of x
    before its tile, and that serial pass cost each program about what a narrow tile's GEMV
    does (the 4B body's linears 2170 us a step at their best tiles, against 1059 for the GEMV
    on x made ready: bench/int4_gemv.py --fused). A separate launch
    costs ~1.7 us a linear instead (1269 us).

    ``PDL`` (programmatic dependent launch): the GEMV after it may launch at once and read its
    first tile of W while this runs; this waits for the kernel before it (which writes x)
    before reading anything."""
    if PDL:
        launch_dependents()
        wait_for_the_kernel_before()
    rk = tl.program_id(0) * PRE_BLOCK + tl.arange(0, PRE_BLOCK)
    rstd = 1.0
    if PRO == 1:
        rstd = row_rstd(x_ptr, 0, K, 0, eps, KP, PRE_BLOCK)
    x, a, b = x_loads(x_ptr, z_ptr, nw_ptr, 0, rk, K, 0, 0, PRO, HEAD)
    x = x_math(x, a, b, rstd, eps, offset, PRO, HEAD, PRE_BLOCK).to(tl.float32)
    x16 = tl.clamp(x * 0.015625, -65504.0, 65504.0).to(tl.float16)
    tl.store(ready_ptr + (rk % 2) * (K // 2) + rk // 2, x16, mask=rk < K)


@triton.jit
def int4_epilogue_kernel(ready_ptr, w_ptr, s_ptr, r_ptr, y_ptr, N, K, stride_wn, stride_sn,
                         cs_ptr, cw_ptr, C, stride_csm, B0, NB, HAS_RES: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         CONV_W: tl.constexpr = 0, CONV_WP: tl.constexpr = 1,
                         BETA: tl.constexpr = 0, PTX: tl.constexpr = True,
                         PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
    """y (1, N) = ready @ dequant(W)^T (+ r): int4_gemv_kernel's GEMV on x made ready
    (int4_ready_kernel), with the FP8 draft's epilogue, ``finish``: the convolution CONV_W,
    beta BETA, the residual. ``PDL``: half2_sums' (the residual, the conv state and y are
    touched only after its wait)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = half2_sums(ready_ptr, w_ptr, s_ptr, rn, N, K, stride_wn, stride_sn, GROUP, BLOCK_N,
                   BLOCK_K, True, PTX, PDL, PDL_LATE)
    finish(y, rn, 0, 0, 0, N, s_ptr, r_ptr, y_ptr, y_ptr, y_ptr, 0, 0, cs_ptr, cw_ptr, C,
           stride_csm, B0, NB, False, HAS_RES, 1, CONV_W, CONV_WP, BETA)
