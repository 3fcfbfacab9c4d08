"""The Triton kernel behind unimax.ops.in_proj_tape (imported lazily: Triton is needed only for
CUDA work and the interpreter tests). Its launch and choice live there."""

import triton
import triton.language as tl

from .gemv_kernels import dot_tile, dot_x_tile
from .short_recurrence_kernel import beta_of, conv_silu, decay_of, store_qkv


@triton.jit
def in_proj_tape_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        conv_state, conv_weight, A_log, dt_bias,
                        tape_x, tape_q, tape_k, tape_v, tape_g, tape_beta,
                        stride_xt, stride_qt, stride_vt, stride_gt,
                        KD: tl.constexpr, CD: tl.constexpr, B0: tl.constexpr,
                        HV: tl.constexpr, W: tl.constexpr, NEG_EIGVAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_F32: tl.constexpr):
    """A recording GDN mixer's in-projection over its block's M tokens (all M <= BLOCK_M rows
    of x, a tile of W's rows per program: gemv_kernels.dot_kernel's loop and output), with
    ops.block_mixer's tape written in the epilogue: the program holds every token of its
    columns, which is what the causal convolution over tokens needs.

    Columns (the projection's [mixed | z | b | a]; CD conv channels, KD of them q's and KD
    k's, z up to B0, then HV b's and HV a's): y gets the product rounded, as the plain GEMM
    stores it. A conv channel's rounded values also go to the tape's raw conv input, and,
    past a barrier (its own stores, read back by its other threads), the convolution with
    SiLU over that window and the conv state into the tape's q, k or v (ops.short_recurrence_
    kernel.conv_silu: tape_record_kernel's arithmetic on the same values); a b column's beta
    and an a column's log-decay g go to the tape's gates (``beta_of``, ``decay_of``). So the
    tape holds bit for bit what the plain GEMM followed by tape_record_kernel writes, without
    the tape kernel's launch. Grid: (cdiv(N, BLOCK_N),)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = dot_x_tile(x_ptr, rm, rk, M, K, stride_xm)
        acc = dot_tile(acc, x, w_ptr, rn, rk, N, K, stride_wn, DOT_F32)
    mask_m = rm < M
    inside = mask_m[:, None] & (rn < N)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=inside)
    if pid * BLOCK_N < CD:  # (a tile with conv channels)
        conv = mask_m[:, None] & (rn < CD)[None, :]
        tl.store(tape_x + rm[:, None] * stride_xt + rn[None, :], y, mask=conv)
        tl.debug_barrier()
        out = conv_silu(tape_x, stride_xt, conv_state, conv_weight, rm, rn, mask_m, rn < CD, W)
        store_qkv(tape_q, tape_k, tape_v, out, rm, rn, conv, stride_qt, stride_vt, KD)
    if (pid + 1) * BLOCK_N > B0:  # (a tile with gate columns: b's, then a's)
        head_b = rn - B0
        head_a = rn - B0 - HV
        is_b = (head_b >= 0) & (head_b < HV)
        is_a = (head_a >= 0) & (head_a < HV)
        A = tl.load(A_log + head_a, mask=is_a, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias + head_a, mask=is_a, other=0.0).to(tl.float32)
        gates = rm[:, None] * stride_gt
        tl.store(tape_beta + gates + head_b[None, :], beta_of(y, NEG_EIGVAL),
                 mask=inside & is_b[None, :])
        tl.store(tape_g + gates + head_a[None, :], decay_of(y, A[None, :], bias[None, :]),
                 mask=inside & is_a[None, :])
