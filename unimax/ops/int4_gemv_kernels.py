"""The Triton kernel behind unimax.ops.int4_gemv (imported by it lazily, on CUDA only: its
dequantizer is inline PTX, which Triton's CPU interpreter does not run). Dispatch and the tile
choice live there; the layout is unimax.int4's."""

import triton
import triton.language as tl


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
def int4_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRE_X: tl.constexpr = True):
    """y (1, N) = x (1, K) @ dequant(W).T with packed FP16 arithmetic: nibbles_to_f16, then
    per-lane FP16 running sums of scaled products over a (BLOCK_N, groups, GROUP / 2) tile, the
    group's scale (FP16) a broadcast, one fp32 reduction at the end, times 64. K a multiple of
    BLOCK_K (no masks along K), BLOCK_K of GROUP.

    ``PRE_X`` (the draft's form): x comes ready (int4_gemv.prepare_x: FP16, x / 64, the even
    columns then the odd ones, each contiguous), two vector loads per 16 weights. Off, the
    kernel reads x (1, K) and makes it so itself: each thread holds its own rows, so that work
    is paid per weight, and ncu counted 5.7 instructions a weight against 2.9 ready, 0.52 of
    the H200's copy bandwidth against 0.82 (bench/int4_gemv.py compares the two)."""
    HALF: tl.constexpr = GROUP // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, GROUPS)
    rh = tl.arange(0, HALF)
    rows = rn[:, None, None] < N
    acc = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float16)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP + rg  # (GROUPS,)
        rb = g[:, None] * HALF + rh[None, :]  # packed byte columns (GROUPS, HALF)
        b = tl.load(w_ptr + rn[:, None, None] * stride_wn + rb[None, :, :], mask=rows,
                    other=136)
        lo, hi = nibbles_to_f16(b)
        if PRE_X:
            x_even = tl.load(x_ptr + rb)
            x_odd = tl.load(x_ptr + K // 2 + rb)
        else:
            x_even = (tl.load(x_ptr + 2 * rb).to(tl.float32) * 0.015625).to(tl.float16)
            x_odd = (tl.load(x_ptr + 2 * rb + 1).to(tl.float32) * 0.015625).to(tl.float16)
        scale = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=rn[:, None] < N,
                        other=0.0)
        acc += (lo * x_even[None, :, :] + hi * x_odd[None, :, :]) * scale[:, :, None]
    y = tl.sum(tl.sum(acc.to(tl.float32), axis=2), axis=1) * 64.0
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)
