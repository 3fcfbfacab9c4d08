"""A recording GDN mixer's in-projection with its tape written in the GEMM's epilogue, as one
op: ``in_proj_tape(x, weight, conv_state, conv_weight, A_log, dt_bias, *tape, conv_dim,
value_dim, neg_eigval) -> y``, y = x @ weight^T, the projection's [mixed | z | b | a], and the
tape's first M tokens filled as ops.block_mixer.gdn_block_record fills them from y.

Why: the verify block ran the in-projection's tensor-core GEMM, then the tape's kernel, per GDN
layer. At 4B on the H200 the tape kernel is ~4.6 us a layer (147 us in 32 launches a block,
bench/RESULTS.md) with a gap before it: the verify block's 1.30 BF16
steps hold ~0.06 of it. The GEMM's programs hold every token of their columns, so the causal
convolution over tokens and the gates fit its epilogue (``in_proj_tape_kernel``), and each
channel is written once (putting the tape into the recurrence's kernel instead made every
one of a head's programs redo its convolution: 4.04 against 3.47 ms a block,
reverted).

Which form runs is a timed choice per shape (ops.gemv.timed_choice, in graphs): the kernel at
the plain GEMM's tile for the shape and at a default tile (``candidates``), or "apart", the
plain small-M linear (its own choice) then the tape's op, which is where things stood. The
forms' y and tape are the same function of x (the tape from y's rounded values, with
tape_record_kernel's arithmetic); y's fp32 sums follow the tile, as the plain GEMM's do.

``in_proj_tape_ref`` is the twin (F.linear, then the tape's torch forms), which the op runs
off CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from . import block_mixer
from .choices import ChoiceTable
from .gemv import (
    GEMV_ROWS,
    PROGRAM_ROWS,
    TILES,
    _interpreted,
    dot_rows,
    parse_kernel,
    small_m_linear,
    tile_args,
    tile_text,
    tiled_names,
    timed_choice,
)

# Whether the verifier view's recording mixers run this op (unimax.fast_step) is the kernel
# configuration's ``tape_epilogue`` (on: bit-equal to the GEMM + tape kernel at 4B, and the
# verify 8 block at 1.349 against 1.488 ms at 0.8B, 3.540 against 3.559 at 4B, H200). The
# per-shape timed choice still keeps "apart" wherever that is faster.
CHOICES = ChoiceTable("in_proj_tape")  # (M, K, N, conv_dim, dtype, neg_eigval) -> a name


def split(y: torch.Tensor, conv_dim: int, value_dim: int) -> tuple[torch.Tensor, ...]:
    """The projection's output (M, N) -> mixed, b, a as the tape's op takes them (1, M, .)."""
    heads = (y.shape[1] - conv_dim - value_dim) // 2
    mixed, _, b, a = y.unsqueeze(0).split([conv_dim, value_dim, heads, heads], dim=-1)
    return mixed, b, a


def check(x, weight, conv_state, conv_weight, tape, conv_dim: int, value_dim: int) -> None:
    """Names what does not fit the op (the tape's shapes as ops.block_mixer.check names them)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or \
            weight.stride(1) != 1:
        raise ValueError(f"in_proj_tape: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be (M, K) and (N, K), the weight's rows contiguous")
    heads = tape[4].shape[-1]
    if weight.shape[0] != conv_dim + value_dim + 2 * heads:
        raise ValueError(f"in_proj_tape: the weight's {weight.shape[0]} rows must be conv_dim "
                         f"{conv_dim} + value_dim {value_dim} + 2 x {heads} heads")
    if not 0 < x.shape[0] <= GEMV_ROWS:
        raise ValueError(f"in_proj_tape: 1 to {GEMV_ROWS} rows, got {x.shape[0]}")
    meta = torch.empty(1, x.shape[0], weight.shape[0], device="meta", dtype=x.dtype)
    mixed, b, a = split(meta[0], conv_dim, value_dim)
    try:
        block_mixer.check(mixed, a, b, conv_state, conv_weight, tape)
    except ValueError as error:  # (named as this op's)
        raise ValueError(str(error).replace("gdn_block_record", "in_proj_tape", 1)) from None


def in_proj_tape_ref(x, weight, conv_state, conv_weight, A_log, dt_bias, tape, conv_dim: int,
                     value_dim: int, neg_eigval: bool) -> torch.Tensor:
    """The twin: the product, then the tape's torch forms on its rounded output."""
    y = F.linear(x, weight)
    mixed, b, a = split(y, conv_dim, value_dim)
    block_mixer.gdn_block_record_ref(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, tape,
                                     neg_eigval)
    return y


def launch(x, weight, conv_state, conv_weight, A_log, dt_bias, tape, conv_dim: int,
           value_dim: int, neg_eigval: bool, tile: tuple[int, ...]) -> torch.Tensor:
    """The kernel at one of ops.gemv's "dot" tiles (CUDA, or Triton's interpreter, whose BF16
    dots are wrong: fp32 there, as ops.gemv's dot kernel takes)."""
    import triton

    from .in_proj_tape_kernel import in_proj_tape_kernel

    tape_x, q, k, v, g, beta = tape
    m, n = x.shape[0], weight.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    args = tile_args(tile)
    in_proj_tape_kernel[(triton.cdiv(n, args["BLOCK_N"]),)](
        x, weight, y, m, n, x.shape[1], x.stride(0), weight.stride(0), y.stride(0), conv_state,
        conv_weight, A_log, dt_bias, tape_x, q, k, v, g, beta, tape_x.stride(1), q.stride(1),
        v.stride(1), g.stride(1), KD=q.shape[2] * q.shape[3], CD=conv_dim,
        B0=conv_dim + value_dim, HV=g.shape[2], W=conv_weight.shape[1], NEG_EIGVAL=neg_eigval,
        BLOCK_M=dot_rows(m), DOT_F32=_interpreted(), **args)
    return y


def names() -> tuple[str, ...]:
    return ("apart",) + tiled_names(("dot",), TILES)


def candidates(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, ...]:
    """What the per-shape choice times: "apart", the kernel at the plain GEMM's own tile for
    this shape (ops.gemv's timed choice, where it took "dot" at a tile) and at ops.gemv's
    default "dot" tile (DOT_TILE): two compiles per BLOCK_M at most, not nine."""
    from . import gemv

    kernels = [f"dot@{tile_text(gemv.DOT_TILE)}"]
    plain = gemv.choose(x, weight, None)
    if plain.startswith("dot@"):
        kernels.insert(0, plain)
    return ("apart", *dict.fromkeys(kernels))


def run(name: str, x, weight, conv_state, conv_weight, A_log, dt_bias, tape, conv_dim: int,
        value_dim: int, neg_eigval: bool) -> torch.Tensor:
    """One form by name: "apart" (the plain small-M linear, then the tape's op) or "dot@tile"
    (the kernel)."""
    if name == "apart":
        y = small_m_linear(x, weight)
        mixed, b, a = split(y, conv_dim, value_dim)
        block_mixer.gdn_block_record(mixed, a, b, conv_state, conv_weight, A_log, dt_bias,
                                     *tape, neg_eigval)
        return y
    form, tile = parse_kernel(name, TILES, "in_proj_tape")
    if form != "dot" or tile is None:
        raise ValueError(f"in_proj_tape: kernel must be one of {', '.join(names())}, got "
                         f"{name!r}")
    return launch(x, weight, conv_state, conv_weight, A_log, dt_bias, tape, conv_dim,
                  value_dim, neg_eigval, tile)


def wanted(x: torch.Tensor) -> bool:
    """Whether a recording block's in-projection over x (M, K) takes this op: on CUDA with
    fla's kernels (ops.block_mixer.usable), more than PROGRAM_ROWS and at most GEMV_ROWS rows,
    with the kernel configuration's ``tape_epilogue`` (read per call: an A/B builds a second
    engine with it off)."""
    return (kernels.active().tape_epilogue and x.is_cuda and PROGRAM_ROWS < x.shape[0] <= GEMV_ROWS
            and block_mixer.usable(x))


@torch.library.custom_op("unimax::in_proj_tape", mutates_args=block_mixer.TAPE_ARGS)
def in_proj_tape(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                 conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 tape_x: torch.Tensor, tape_q: torch.Tensor, tape_k: torch.Tensor,
                 tape_v: torch.Tensor, tape_g: torch.Tensor, tape_beta: torch.Tensor,
                 conv_dim: int, value_dim: int, neg_eigval: bool) -> torch.Tensor:
    """x (M, K) @ weight^T with the tape of its M tokens written: the chosen form on CUDA
    (timed once per shape), the twin elsewhere."""
    tape = (tape_x, tape_q, tape_k, tape_v, tape_g, tape_beta)
    check(x, weight, conv_state, conv_weight, tape, conv_dim, value_dim)
    args = (conv_state, conv_weight, A_log, dt_bias)
    if not (x.is_cuda and not _interpreted() and block_mixer.usable(x)):
        return in_proj_tape_ref(x, weight, *args, tape, conv_dim, value_dim, neg_eigval)
    key = (*x.shape, weight.shape[0], conv_dim, x.dtype, neg_eigval)
    if key not in CHOICES and not torch.cuda.is_current_stream_capturing():
        # "apart" once first: its own choices (the GEMM's tile, the tape kernel's) made here,
        # not inside the timing's graphs, where a first-met choice takes its default
        run("apart", x, weight, *args, tape, conv_dim, value_dim, neg_eigval)
    name = CHOICES.get(key) or timed_choice(
        CHOICES, key, candidates(x, weight), "apart", True,
        lambda name, w: run(name, x, w, *args, tape, conv_dim, value_dim, neg_eigval),
        (weight,))
    return run(name, x, weight, *args, tape, conv_dim, value_dim, neg_eigval)


@in_proj_tape.register_fake
def _(x, weight, conv_state, conv_weight, A_log, dt_bias, tape_x, tape_q, tape_k, tape_v,
      tape_g, tape_beta, conv_dim, value_dim, neg_eigval):
    return x.new_empty(x.shape[0], weight.shape[0])
