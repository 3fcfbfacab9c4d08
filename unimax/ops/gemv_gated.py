"""A GDN mixer's gated RMSNorm and out-projection at the verifier's few rows, as one op:
y = (rmsnorm_per_head(o) * w * act(z)) @ W^T for o, z (M, heads x D), W (N, heads x D).

The verifier's block of k + 1 rows ran the gated norm as inductor's kernels: two a layer at 4B
(a reduction for the heads' mean squares, then the pointwise norm and gate; 82 us of a 4B
verify block's 3.34 ms busy in 64 launches, plus their gaps: bench/RESULTS.md, twenty-fifth
session's kernels), then the out-projection's GEMM. Here ops.gemv's tensor-core kernels
("dot", "dotsplit") normalize each tile of o as they load it (``GATED``: whole heads in a
tile, so a tile's columns hold every value its heads' sums need): the norm is the product's
prologue. Which form and tile runs is timed per shape, as ops.gemv times its kernels; tiles
whose K step does not hold whole heads are not offered.

Rounding: as the eager forms (``gated_linear_ref``, the twin): the normalized, gated o rounded
to its dtype, then the product. The heads' sums run in another order than torch's, and the
kernel's sigmoid is not torch's silu to the last bit, so a few elements of the normalized input
may land one rounding step apart; the tests bound them.

Off (``GATED_PROLOGUE``) until a GPU run has timed it against inductor's kernels
(bench/verified.py --ab-gated).
"""

from __future__ import annotations

import torch

from ..norms import gated_rms_norm_ref
from .gemv import (
    GEMV_ROWS,
    TILES,
    dotsplit_fits,
    gemv,
    gemv_ref,
    small_m_linear,
    tile_text,
    timed_choice,
)

GATED_PROLOGUE = False  # the verifier view's GDN mixers run this op (unimax.layers)
CHOICES: dict[tuple, str] = {}  # (M, N, K, head dim, weight dtype) -> "dot@tile", "dotsplit@tile"
ACTIVATIONS = {"silu": 1, "sigmoid": 2}


def gated_linear_ref(x, z, norm_weight, eps: float, activation: str, weight, scale=None):
    """The twin: x, z (M, K = heads x D), norm_weight (D,) -> (M, N)."""
    m, k = x.shape
    d = norm_weight.shape[0]
    normed = gated_rms_norm_ref(x.reshape(m, k // d, d), z.reshape(m, k // d, d), norm_weight,
                                eps, activation)
    return gemv_ref(normed.reshape(m, k), weight, scale)


def check(x, z, norm_weight, activation: str, weight) -> None:
    """Names what does not fit the op."""
    problems = []
    if x.dim() != 2 or z.shape != x.shape or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        problems.append(f"x {tuple(x.shape)} and z {tuple(z.shape)} must both be (M, K) and "
                        f"the weight {tuple(weight.shape)} (N, K)")
    d = norm_weight.shape[0] if norm_weight.dim() == 1 else 0
    if not d or x.shape[-1] % d:
        problems.append(f"the norm weight {tuple(norm_weight.shape)} must be one head's (D,), "
                        f"D dividing K = {x.shape[-1]}")
    if activation not in ACTIVATIONS:
        problems.append(f"activation must be silu or sigmoid, got {activation!r}")
    if x.dim() == 2 and x.shape[0] > GEMV_ROWS:
        problems.append(f"at most {GEMV_ROWS} rows, got {x.shape[0]}")
    if problems:
        raise ValueError("gated linear: " + "; ".join(problems))


def names(m: int, n: int, k: int, head_dim: int) -> tuple[str, ...]:
    """The kernels offered: "dot" and (where it fits) "dotsplit" at every tile whose K step
    holds whole heads."""
    forms = ("dot",) + (("dotsplit",) if dotsplit_fits(m, n, k) else ())
    return tuple(f"{form}@{tile_text(tile)}" for form in forms for tile in TILES[form]
                 if tile[1] % head_dim == 0)


def gemv_gated(x, z, norm_weight, eps: float, activation: str, weight, scale=None,
               kernel: str = "dot@32x256x4x3") -> torch.Tensor:
    """The op's kernel by name (one of ``names``): the Triton kernel with the gated norm as its
    prologue (CUDA, or Triton's interpreter). Same contract as ``gated_linear_ref``."""
    check(x, z, norm_weight, activation, weight)
    head_dim = norm_weight.shape[0]
    block_k = int(kernel.partition("@")[2].split("x")[1]) if "@" in kernel else 0
    if block_k % head_dim or not block_k:
        raise ValueError(f"gated linear: kernel {kernel!r} must name a tile whose K step "
                         f"holds whole heads of {head_dim}")
    return gemv(x, weight, scale, kernel=kernel,
                gated=(z.contiguous(), norm_weight, float(eps), ACTIVATIONS[activation],
                       head_dim))


def fits(x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether any tile holds whole heads of this mixer (heads of up to 512 values)."""
    return bool(names(x.shape[0], 1, x.shape[1], norm_weight.shape[0]))


@torch.library.custom_op("unimax::small_m_gated_linear", mutates_args=())
def small_m_gated_linear(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                         weight: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """x, z (M <= GEMV_ROWS, K), norm_weight (D,), weight (N, K) BF16 -> the gated norm of x
    and its product with weight: one Triton kernel on CUDA, its form and tile timed once per
    shape (ops.gemv.timed_choice); the twin's torch forms elsewhere."""
    check(x, z, norm_weight, activation, weight)
    if not x.is_cuda:
        return gated_linear_ref(x, z, norm_weight, eps, activation, weight)
    m, k = x.shape
    key = (m, weight.shape[0], k, norm_weight.shape[0], weight.dtype)
    offered = names(m, weight.shape[0], k, norm_weight.shape[0])
    if not offered:  # (no tile holds a head: the norm, then the plain linear)
        d = norm_weight.shape[0]
        normed = gated_rms_norm_ref(x.reshape(m, k // d, d), z.reshape(m, k // d, d),
                                    norm_weight, eps, activation)
        return small_m_linear(normed.reshape(m, k), weight)

    def run(name, w):
        return gemv_gated(x, z, norm_weight, eps, activation, w, None, name)

    name = CHOICES.get(key) or timed_choice(CHOICES, key, offered, offered[0], True, run,
                                            (weight,))
    return run(name, weight)


@small_m_gated_linear.register_fake
def _(x, z, norm_weight, weight, eps, activation):
    return x.new_empty(x.shape[0], weight.shape[0])
