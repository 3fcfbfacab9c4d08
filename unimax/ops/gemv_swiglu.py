"""An MLP's gate-up product and its SwiGLU at the verifier's few rows, as one op:
y = silu(x @ gate^T) * (x @ up^T) for x (M, K), W = [gate; up] (2N, K), y (M, N).

The verifier's block of k + 1 rows runs its MLP in the plain forms (unimax.fused_draft folds
only one-token steps), so each layer paid the gate-up GEMM, then inductor's SwiGLU kernel, then
the down GEMM. Here the tensor-core kernel of ops.gemv ("dot") takes the same rows of both
halves per program and applies the activation in its epilogue: one launch a layer fewer
(at 4B ~32 launches, their gaps, and a 9 x 18432 round trip; on the H200 a launch in a graph is
~2.5-4 us with its ramp and tail: bench/RESULTS.md). Which form runs is timed per shape as
ops.gemv times its kernels: "dot" at each of its tiles with the activation in the epilogue, or
cuBLAS's GEMM followed by one activation kernel (``swiglu_act``), which is where things stood
before, in launches.

Rounding: the products are rounded to x's dtype (as a GEMM's output is), silu(gate) is rounded
again, then the product with up: the eager torch forms' ``F.silu(gate) * up`` on the rounded
GEMM output (``swiglu_ref``, the twin). Every form rounds so; they may differ where sigmoid's
implementations differ in fp32's last bit, which the tests bound.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .choices import ChoiceTable
from .gemv import (
    GEMV_ROWS,
    TILES,
    _interpreted,
    gemv,
    gemv_ref,
    parse_kernel,
    tiled_names,
    timed_choice,
)

CHOICES = ChoiceTable("gemv_swiglu")  # (M, 2N, K, weight dtype) -> "dot@tile" or "cublas"
ACT_BLOCK = 1024  # swiglu_act's columns per program


def swiglu_ref(x: torch.Tensor, weight: torch.Tensor,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: x (M, K), weight [gate; up] (2N, K) (scale (2N,) or None) -> (M, N)."""
    gate, up = gemv_ref(x, weight, scale).chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_act(gate_up: torch.Tensor) -> torch.Tensor:
    """(M, 2N) [gate, up] -> (M, N) silu(gate) * up, rounded as ``swiglu_ref``: one Triton
    kernel on CUDA (and in the interpreter), the torch forms elsewhere."""
    half = gate_up.shape[-1] // 2
    if not (gate_up.is_cuda or _interpreted()):
        gate, up = gate_up.split(half, dim=-1)
        return F.silu(gate) * up
    import triton

    from .gemv_kernels import swiglu_kernel

    m = gate_up.shape[0]
    y = torch.empty(m, half, device=gate_up.device, dtype=gate_up.dtype)
    swiglu_kernel[(triton.cdiv(half, ACT_BLOCK), m)](gate_up, y, half, gate_up.stride(0),
                                                    y.stride(0), BLOCK=ACT_BLOCK)
    return y


def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                kernel: str = "dot") -> torch.Tensor:
    """The op's forms, by name: "dot" or "dot@tile" (ops.gemv's tensor-core kernel, the
    activation in its epilogue), or "cublas" (``F.linear``, BF16 weights, then
    ``swiglu_act``). Same contract as ``swiglu_ref``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv_swiglu: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be (M, K) and (2N, K)")
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_swiglu: the weight stacks gate and up, so its rows must be "
                         f"even, got {weight.shape[0]}")
    if kernel == "cublas":
        if scale is not None:
            raise ValueError("gemv_swiglu: cublas is for BF16 weights (no scales)")
        return swiglu_act(F.linear(x, weight))
    form, _ = parse_kernel(kernel, TILES, "gemv_swiglu")
    if form != "dot":
        raise ValueError(f"gemv_swiglu: kernel must be dot (optionally @tile) or cublas, "
                         f"got {kernel!r}")
    return gemv(x, weight, scale, kernel=kernel, swiglu=True)


def choose(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    """The fastest form for this shape, timed once in graphs (ops.gemv.timed_choice); "dot"
    (autotuned) where it cannot be timed."""
    key = (x.shape[0], *weight.shape, weight.dtype)
    if key in CHOICES:
        return CHOICES[key]
    names = tiled_names(("dot",), TILES) + (() if scale is not None else ("cublas",))
    return timed_choice(CHOICES, key, names, "dot", x.is_cuda,
                        lambda name, w, s: gemv_swiglu(x, w, s, name), (weight, scale))


@torch.library.custom_op("unimax::small_m_swiglu", mutates_args=())
def small_m_swiglu(x: torch.Tensor, weight: torch.Tensor,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """x (M <= GEMV_ROWS, K), weight [gate; up] (2N, K) -> silu(x @ gate^T) * (x @ up^T)."""
    if x.shape[0] > GEMV_ROWS:
        raise ValueError(f"small_m_swiglu: at most {GEMV_ROWS} rows, got {x.shape[0]}")
    return gemv_swiglu(x, weight, scale, choose(x, weight, scale))


@small_m_swiglu.register_fake
def _(x, weight, scale=None):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)
