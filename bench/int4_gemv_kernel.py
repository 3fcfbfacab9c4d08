"""A Triton GEMV over int4 weights with a scale per GROUP columns (bench/int4_gemv.py times it;
imported lazily: Triton is needed only there and in the interpreter test).

Layout (int4_gemv.pack_nibbles): byte j of a row holds column 2j in its low nibble and column
2j + 1 in its high one, each stored as q + 8 (q in -7..7, symmetric); scales (N, K / GROUP).
Each program streams BLOCK_N rows once, sums each group's products in fp32 and scales the
group's sum, so the per-element work is two nibble extractions and two FMAs.
"""

import triton
import triton.language as tl


@triton.jit
def int4_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y (1, N) = x (1, K) @ dequant(W).T; BLOCK_K unpacked columns a step, a multiple of
    GROUP."""
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
