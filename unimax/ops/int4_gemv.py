"""The int4 draft's GEMV: y (1, N) = x (1, K) @ dequant(W)^T, W packed two weights a byte with
an FP16 scale per group of columns (unimax.int4's layout), for the int4 draft's one-token steps
on CUDA.

Why x goes in "ready" (``prepare_x``: FP16, x / 64, the even columns then the odd ones): an
int4 GEMV's threads each hold their own rows, so whatever the kernel does to x it does again for
every weight; with x loaded, converted and scaled inside, every int4 kernel measured on the H200
(ours, and torch's tinygemm) stopped near 0.5 of the copy bandwidth at ~6 instructions a weight,
issue-bound, and with x ready the same kernel needed 2.9 and reached 0.82 (bench/int4_gemv.py,
bench/RESULTS.md). Inside a compiled step ``prepare_x`` is plain torch, so
inductor folds it into the kernel that makes x (the RMSNorm, the gated norm, the SwiGLU); where
the draft's blocks are fused (unimax.fused_draft, the default) ops.int4_fused makes x ready in
the GEMV's own launch instead, and this op serves Int4Linear's plain forward.

``int4_matvec`` is a torch custom op (``unimax::int4_matvec``) with a fake kernel, so a compiled
step traces through it without a graph break; it chooses its tile once per shape at first use,
timed in graphs as ops.gemv's choices are (``timed_choice``). ``int4_matvec_ref`` is its plain
twin, what runs off CUDA.
"""

import functools

import torch

from .choices import ChoiceTable
from .gemv import _interpreted, tile_text, timed_choice
from .int4_format import dequantize_packed

# (BLOCK_N, BLOCK_K, warps): those that won a 4B or 0.8B draft linear, or the 537 M-weight one,
# on the H200 (bench/int4_gemv.py), and smaller ones; a shape takes those whose BLOCK_K divides
# K and is a multiple of its group.
INT4_TILES = ((2, 2048, 4), (4, 1024, 4), (8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 4),
              (64, 256, 8), (32, 128, 4), (8, 128, 4))
CHOICES = ChoiceTable("int4_gemv")  # (N, K, group) -> tile text


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x / 64 in FP16 (exact scaling; FP16 keeps |x| up to 64 x 65504, and is clamped there,
    as ops.gemv's FP16 form does): the kernel's x, any number of rows."""
    return (x.float() * 0.015625).clamp(-65504.0, 65504.0).to(torch.float16)


def prepare_x(x: torch.Tensor) -> torch.Tensor:
    """x (1, K) as the kernel reads it: (2, K / 2), rounded_x's, the even columns then the odd
    ones."""
    return rounded_x(x).reshape(-1, 2).t().contiguous()


def unprepare_x(ready: torch.Tensor) -> torch.Tensor:
    """prepare_x's inverse, in fp32: (2, K / 2) -> (1, K)."""
    return ready.float().t().reshape(1, -1) * 64.0


def int4_matvec_ref(ready: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """The plain twin: the weight dequantized (ops.int4_format.dequantize_packed), fp32 sums."""
    return (unprepare_x(ready) @ dequantize_packed(packed, scale).t()).to(out_dtype)


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ dequant(W)^T in x's dtype, x rounded as the kernel takes it (rounded_x) and
    fp32 sums: the twin for any number of rows (Int4Linear's, ops.int4_fused's)."""
    weight = dequantize_packed(packed, scale)
    return ((rounded_x(x).float() * 64.0) @ weight.t()).to(x.dtype)


def tiles_for(k: int, group: int) -> tuple[tuple[int, int, int], ...]:
    """The INT4_TILES that fit K and the group, or one of a single group a step if none does."""
    fit = tuple(t for t in INT4_TILES if t[1] % group == 0 and k % t[1] == 0)
    return fit or ((16, group, 4),)


def launch(ready: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           out_dtype: torch.dtype, tile: tuple[int, int, int]) -> torch.Tensor:
    """One launch of the kernel at ``tile`` (CUDA, or the interpreter: no PTX there)."""
    from .int4_gemv_kernels import int4_gemv_kernel

    n, k = packed.shape[0], 2 * packed.shape[1]
    block_n, block_k, warps = tile
    y = torch.empty(1, n, device=ready.device, dtype=out_dtype)
    int4_gemv_kernel[(-(-n // block_n),)](ready, packed, scale, y, n, k, packed.stride(0),
                                         scale.stride(0), GROUP=k // scale.shape[1],
                                         BLOCK_N=block_n, BLOCK_K=block_k,
                                         PTX=not _interpreted(), num_warps=warps)
    return y


@functools.cache
def _tile(text: str) -> tuple[int, int, int]:
    return tuple(int(v) for v in text.split("x"))


def choose(ready: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           out_dtype: torch.dtype) -> tuple[int, int, int]:
    """The fastest tile of ``tiles_for`` this shape, timed once (ops.gemv.timed_choice); the
    first one where it cannot be timed."""
    k, group = 2 * packed.shape[1], 2 * packed.shape[1] // scale.shape[1]
    key = (packed.shape[0], k, group)
    name = CHOICES.get(key)
    if name is None:  # (the first call of this shape only)
        names = tuple(tile_text(t) for t in tiles_for(k, group))
        name = timed_choice(CHOICES, key, names, names[0], ready.is_cuda,
                            lambda name, p, s: launch(ready, p, s, out_dtype, _tile(name)),
                            (packed, scale))
    return _tile(name)


def check_args(ready: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    k = 2 * packed.shape[1]
    if ready.shape != (2, k // 2) or ready.dtype != torch.float16:
        raise ValueError(f"int4_matvec: x must come as prepare_x makes it, (2, {k // 2}) "
                         f"float16, for a packed weight of K = {k}; got {tuple(ready.shape)} "
                         f"{ready.dtype}")
    check_storage(packed, scale, "int4_matvec")


def check_storage(packed: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """Names a weight not stored as unimax.int4 stores it (``what``: the caller)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float16 or \
            scale.shape[0] != packed.shape[0] or (2 * packed.shape[1]) % scale.shape[1]:
        raise ValueError(f"{what}: packed (N, K / 2) uint8 and scale (N, K / group) float16 "
                         f"(unimax.int4.quantize_packed); got {packed.dtype} "
                         f"{tuple(packed.shape)} and {scale.dtype} {tuple(scale.shape)}")


@torch.library.custom_op("unimax::int4_matvec", mutates_args=())
def int4_matvec(ready: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """x (ready: prepare_x) @ dequant(packed, scale)^T -> (1, N) in ``out_dtype``: the Triton
    kernel at its timed tile on CUDA, the twin elsewhere."""
    check_args(ready, packed, scale)
    if not ready.is_cuda:
        return int4_matvec_ref(ready, packed, scale, out_dtype)
    return launch(ready.contiguous(), packed, scale, out_dtype,
                  choose(ready, packed, scale, out_dtype))


@int4_matvec.register_fake
def _(ready, packed, scale, out_dtype):
    return ready.new_empty(1, packed.shape[0], dtype=out_dtype)
