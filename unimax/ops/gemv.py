"""GEMV for decoding: y = x @ (W * s)^T for a few rows of x, W (N, K) in BF16 or FP8
(float8_e4m3fn, with one fp32 scale per output row), activations never quantized.

At batch 1 a decode step's linears are matrix-vector products: the time is reading W. cuBLAS
picks GEMM tiles built for larger M: on the H200 it read the 248k-row LM head in FP8
(``torch._scaled_mm``, which first quantizes the activation) barely faster than in BF16, and a
compiled GDN step's BF16 projections at 1.4-2 TB/s of the card's ~4 (bench/RESULTS.md). This
kernel streams the rows once, converts them in registers and accumulates in fp32: nothing but
the bytes of W. Rows of x are independent programs (meant for M <= 4); the tile shape is tuned
per (N, K, dtype) at first use, i.e. in the warm-up before a graph is captured.

``gemv_ref`` is its plain-torch twin (same stored weights and scales, fp32 accumulate).
"""

from __future__ import annotations

import functools
import os

import torch

GEMV_ROWS = 4  # callers send up to this many rows through the GEMV (decode steps), more to cuBLAS


def gemv_ref(x: torch.Tensor, weight: torch.Tensor,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K), scale (N,) fp32 or None -> (M, N) in x's dtype."""
    y = x.float() @ weight.float().t()
    if scale is not None:
        y = y * scale[None, :]
    return y.to(x.dtype)


@functools.cache
def _kernel(scaled: bool):
    """One autotuned kernel per weight kind (FP8 with scales, BF16 without): the best tile for
    a (N, K) differs between 1- and 2-byte weights, and the tuner's key is (N, K)."""
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
               for n, k, w in ((4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4),
                               (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 4),
                               (32, 512, 8), (64, 128, 4), (64, 256, 8), (128, 128, 8))]

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :],
                        mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y = y * tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)

    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter (tests): no timing
        return triton, gemv_kernel, {"BLOCK_N": 16, "BLOCK_K": 64}
    return triton, triton.autotune(configs=configs, key=["N", "K"])(gemv_kernel), {}


def gemv(x: torch.Tensor, weight: torch.Tensor,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA). Same contract as ``gemv_ref``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be (M, K) and (N, K)")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous (stride 1 along K)")
    triton, kernel, fixed = _kernel(scale is not None)
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)  # noqa: E731
    kernel[grid](x, weight, x if scale is None else scale, y, n, k, x.stride(0),
                 weight.stride(0), y.stride(0), HAS_SCALE=scale is not None, **fixed)
    return y
