"""FP8-weight GEMV for decoding: y = x @ (W_q * s)^T with W_q float8_e4m3fn (N, K), one fp32
scale per output row, and BF16 activations that are never quantized.

At batch 1 a decode step's linears are matrix-vector products: the time is reading W. cuBLAS's
FP8 GEMM (``torch._scaled_mm``) is built for large M and first has to quantize the activation;
at M=1 it read the 248k-row LM head barely faster than BF16 (bench/RESULTS.md). This kernel
streams the FP8 rows once, converts them in registers and accumulates in fp32: half the bytes
of the BF16 GEMV, nothing else. Rows of x are independent programs (meant for M <= 4).

``fp8_gemv_ref`` is its plain-torch twin (same stored weights and scales, fp32 accumulate).
"""

from __future__ import annotations

import functools
import os

import torch


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K), weight (N, K) fp8, scale (N,) fp32 -> (M, N) in x's dtype."""
    return (x.float() @ weight.float().t() * scale[None, :]).to(x.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
               for n, k, w in ((8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 4),
                               (32, 512, 8), (64, 128, 4), (64, 256, 8), (128, 128, 8))]

    @triton.jit
    def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                        mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        y = tl.sum(acc, axis=1) * scale
        tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)

    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter (tests): no timing
        return triton, fp8_gemv_kernel, {"BLOCK_N": 16, "BLOCK_K": 64}
    # Tuned per (N, K) at first use, i.e. in the warm-up before a graph is captured.
    return triton, triton.autotune(configs=configs, key=["N", "K"])(fp8_gemv_kernel), {}


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA). Same contract as ``fp8_gemv_ref``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be (M, K) and (N, K)")
    triton, kernel, fixed = _kernel()
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)  # noqa: E731
    kernel[grid](x, weight, scale, y, n, k, x.stride(0), weight.stride(0), y.stride(0), **fixed)
    return y
