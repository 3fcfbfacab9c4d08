"""A Triton GEMV over int4 weights with a scale per GROUP columns (bench/int4_gemv.py times it;
imported lazily: Triton is needed only there and in the interpreter test).

Layout (int4_gemv.pack_nibbles): byte j of a row holds column 2j in its low nibble and column
2j + 1 in its high one, each stored as q + 8 (q in -7..7, symmetric); scales (N, K / GROUP).
Each program streams BLOCK_N rows once, sums each group's products in fp32 and scales the
group's sum, so the per-element work is two nibble extractions and two FMAs.

Measured (H200, thirty-ninth and fortieth sessions, bench/RESULTS.md): that form, and torch's
tinygemm, stop at ~4e12 weights a second whatever the size (0.47-0.49 of the copy bandwidth on a
537 M-weight linear, where the FP8 GEMV reaches 0.95-0.99). Not for the int-to-float conversion
(``MAGIC``, without it, runs at 0.49), nor for want of FP16 arithmetic (an FP16 form that
gathered a scale per element ran at 0.19; removed, its figures stay in RESULTS): ncu counts ~6
instructions a weight in all of them, most of them x's loads and conversions, which each thread
repeats for every weight, since it holds its own rows. ``int4_gemv_half2_kernel`` with
``PRE_X`` (x ready before the kernel) needs 2.9 and reaches 0.82 of the bandwidth.
"""

import triton
import triton.language as tl


@triton.jit
def int4_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MAGIC: tl.constexpr = False):
    """y (1, N) = x (1, K) @ dequant(W).T; BLOCK_K unpacked columns a step, a multiple of
    GROUP. ``MAGIC``: no int-to-float conversion, in FP32: (b & 15) | 0x4B000000 is the bit
    pattern of 2^23 + the low nibble and (b & 0xF0) | 0x4B000000 that of 2^23 + 16 x the high
    one (one LOP3 each), so one exact subtraction gives q and 16 q; x_odd / 16 (exact, once
    per block) undoes the 16."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rb = k0 // 2 + tl.arange(0, HALF)  # packed byte columns
        inside = rb < K // 2
        # masked bytes read as 0x88: both nibbles q = 0
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :],
                    mask=(rn[:, None] < N) & inside[None, :], other=136).to(tl.int32)
        x_even = tl.load(x_ptr + 2 * rb, mask=inside, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * rb + 1, mask=inside, other=0.0).to(tl.float32)
        if MAGIC:
            lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            hi = ((b & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            x_odd = x_odd * 0.0625
        else:
            lo = ((b & 15) - 8).to(tl.float32)
            hi = ((b >> 4) - 8).to(tl.float32)
        products = lo * x_even[None, :] + hi * x_odd[None, :]
        sums = tl.sum(tl.reshape(products, (BLOCK_N, GROUPS, GROUP // 2)), axis=2)
        rg = k0 // GROUP + tl.arange(0, GROUPS)
        scale = tl.load(s_ptr + rn[:, None] * stride_sn + rg[None, :],
                        mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP), other=0.0)
        acc += sums * scale.to(tl.float32)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


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
def int4_gemv_half2_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRE_X: tl.constexpr = False):
    """int4_gemv_kernel's result with packed FP16 arithmetic (GPU only: inline PTX, which the
    interpreter does not run): nibbles_to_f16, then per-lane FP16 running sums of scaled
    products over a (BLOCK_N, groups, GROUP / 2) tile, the group's scale (FP16) a broadcast,
    one reduction at the end. x is scaled by 1/64 first (exact), as ops.gemv's rows16; K a
    multiple of BLOCK_K (no masks along K).

    ``PRE_X``: x comes ready (int4_gemv.prepare_x: FP16, / 64, the even columns then the odd
    ones, each contiguous). Each thread holds its own rows, so x loaded, converted and scaled
    here is paid per weight (ncu, fortieth session: ~5.7 instructions a weight in all); ready, it
    is two vector loads per 16 weights."""
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


@triton.jit
def prepare_x_kernel(x_ptr, out_ptr, HALF_K, BLOCK: tl.constexpr):
    """x (1, K) -> (2, K / 2) FP16, x / 64, the even columns then the odd ones: what
    int4_gemv_half2_kernel's PRE_X reads (int4_gemv.prepare_x is its torch twin). One launch,
    as a draft's prologue kernel would be."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = r < HALF_K
    x_even = tl.load(x_ptr + 2 * r, mask=inside, other=0.0).to(tl.float32) * 0.015625
    x_odd = tl.load(x_ptr + 2 * r + 1, mask=inside, other=0.0).to(tl.float32) * 0.015625
    tl.store(out_ptr + r, x_even.to(tl.float16), mask=inside)
    tl.store(out_ptr + HALF_K + r, x_odd.to(tl.float16), mask=inside)
