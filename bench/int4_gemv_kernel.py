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
repeats for every weight, since it holds its own rows. unimax.ops.int4_gemv_kernels'
kernel (packed FP16 dequantization and sums) with x ready before it needs 2.9 and reaches 0.82
of the bandwidth: the int4 draft's GEMV, which int4_gemv.py times as "half2" (x read inside),
"half2x" (x ready) and "half2p" (x made ready by prepare_x_kernel, a launch of its own).
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
def prepare_x_kernel(x_ptr, out_ptr, HALF_K, BLOCK: tl.constexpr):
    """x (1, K) -> (2, K / 2) FP16, x / 64, the even columns then the odd ones: what
    unimax.ops.int4_gemv_kernels' kernel reads (unimax.ops.int4_gemv.prepare_x is its torch
    twin). One launch, as a draft's prologue kernel would be."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = r < HALF_K
    x_even = tl.load(x_ptr + 2 * r, mask=inside, other=0.0).to(tl.float32) * 0.015625
    x_odd = tl.load(x_ptr + 2 * r + 1, mask=inside, other=0.0).to(tl.float32) * 0.015625
    tl.store(out_ptr + r, x_even.to(tl.float16), mask=inside)
    tl.store(out_ptr + HALF_K + r, x_odd.to(tl.float16), mask=inside)
