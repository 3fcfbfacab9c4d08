"""What a recording GDN mixer writes to the verifier's tape over a verify block, as one op:
the short convolution, the gates and the tape's copies, ``gdn_block_record(mixed, a, b,
conv_state, conv_weight, A_log, dt_bias, *tape, neg_eigval)``, which fills the tape's first T
tokens and returns nothing (the heads come from the tape's shapes); the mixer then runs the
recurrence on the tape's q, k, v, g and beta (ops.short_recurrence), as the rewind does.

mixed (1, T, conv_dim) is the in-projection's [q | k | v] part before the convolution, a and b
(1, T, HV) its raw decay and write-strength inputs (views of the projection's output); the
conv state is read, not written (a recording forward leaves the states to the rewind,
unimax.tape); the tape is the layer's (conv input, q, k, v, g, beta) buffers
(unimax.tape.LayerTape).

Why: written as torch ops, this part compiled to ~10 kernels per layer of the 4B verify block
(the block conv, q, k and v made contiguous, the gates, the tape's copies), ~1.2 us each plus
the gaps between launches, in a block of 778 launches and ~1.1 ms of small kernels and gaps
(bench/RESULTS.md). As this op it is one Triton kernel
(ops/short_recurrence_kernel.py: ``tape_record_kernel``).

Why the recurrence is not in the kernel too (an earlier version had it there): the state
at any position must come out bit for bit the same whichever block boundary it was computed
across: the verify block runs it from the block's start, the rewind from the block before's,
and a different rounding makes the verified stream depend on where the blocks were cut (the
forced-acceptance bench then saw its own expected tokens rejected: 22 of 45 blocks at a forced
acceptance of 1.0 on the H200). An fp32 sum's rounding follows the kernel's register layout,
so one recurrence kernel at one launch setting for the block and the rewind is what guarantees
it (ops.short_recurrence keys its choice by the heads alone). Nor is this op's work in the
recurrence's kernel (bench/RESULTS.md: each program writing the tape
entries it reads, then reading them back through the recurrence's own loads, was exact but
made the 4B verify block 4.04 ms against 3.47: the recurrence's one-warp programs of 8 value
columns, 32 per key head, each redid that head's q and k convolution).

``gdn_block_record_ref`` is the twin (the mixer's torch forms), which the op runs off CUDA.
"""

from __future__ import annotations

import torch

from .choices import ChoiceTable
from .conv import causal_conv1d
from .decode_step import decay, write_strength
from .gated_delta import fla_ops
from .gemv import _interpreted, timed_choice
from .short_recurrence import _pow2

# (BC conv channels per program, warps). The kernel is elementwise over tokens and channels,
# all of the block's tokens (up to 64 rows, SHORT_MAX padded) in one program; 4B heads have
# 8192 channels: 128, 64 or 32 programs. The timed choice picks.
TILES = ((64, 1), (128, 2), (256, 4))
CHOICES = ChoiceTable("block_mixer")  # (pow2(T), conv_dim, H, K, HV, V, dtype, neg) -> name


def check(mixed, a, b, conv_state, conv_weight, tape) -> None:
    """Names what does not fit the kernel."""
    problems = []
    batch, tokens, conv_dim = mixed.shape
    x, q, k, v, g, beta = tape
    (num_k_heads, head_k_dim), (value_heads, head_v_dim) = q.shape[2:], v.shape[2:]
    if batch != 1:
        problems.append(f"one sequence, got {batch}")
    if q.dim() != 4 or v.dim() != 4 or k.shape != q.shape or \
            x.shape[2] != conv_dim or \
            conv_dim != 2 * num_k_heads * head_k_dim + value_heads * head_v_dim:
        problems.append(f"mixed has {conv_dim} channels; the tape's q {tuple(q.shape)}, "
                        f"k {tuple(k.shape)}, v {tuple(v.shape)} and conv input "
                        f"{tuple(x.shape)} do not make that")
    if a.shape != (1, tokens, value_heads) or b.shape != (1, tokens, value_heads) or \
            g.shape[2:] != (value_heads,) or beta.shape[2:] != (value_heads,):
        problems.append(f"a, b and the tape's g and beta must have {value_heads} heads, "
                        f"a and b {tokens} tokens")
    if conv_state.shape != (1, conv_dim, conv_weight.shape[1]) or \
            not conv_state.is_contiguous() or not conv_weight.is_contiguous():
        problems.append("conv_state (1, conv_dim, W) and conv_weight (conv_dim, W) must be "
                        "contiguous")
    if any(t.stride(-1) != 1 for t in (mixed, a, b)):
        problems.append("mixed, a and b must have contiguous channels")
    if x.shape[1] < tokens or any(t.shape[0] != 1 or not t.is_contiguous() for t in tape) or \
            len({t.shape[1] for t in tape}) != 1:
        problems.append(f"the tape must be one layer's contiguous buffers of {tokens}+ tokens")
    if problems:
        raise ValueError("gdn_block_record: " + "; ".join(problems))


def gdn_block_record_ref(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, tape,
                         neg_eigval: bool) -> None:
    """The twin: the mixer's torch forms (its recording path, unimax.layers)."""
    tokens = mixed.shape[1]
    y, _ = causal_conv1d(mixed, conv_weight, conv_state)
    key_dim = tape[1].shape[2] * tape[1].shape[3]
    q, k, v = torch.split(y, [key_dim, key_dim, y.shape[2] - 2 * key_dim], dim=-1)
    beta, g = write_strength(b, neg_eigval), decay(a, A_log, dt_bias)
    for buffer, value in zip(tape, (mixed, q, k, v, g, beta), strict=True):
        buffer[:, :tokens].copy_(value.reshape(buffer[:, :tokens].shape))


def launch(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, tape, neg_eigval: bool,
           tile: tuple[int, int]) -> None:
    """The kernel at one tile (BC, warps) of TILES (CUDA, or Triton's interpreter)."""
    import triton

    from .short_recurrence_kernel import tape_record_kernel

    tokens, conv_dim = mixed.shape[1:]
    x, q, k, v, g, beta = tape
    key_dim, value_heads = q.shape[2] * q.shape[3], v.shape[2]
    block_c, warps = tile
    tape_record_kernel[(triton.cdiv(conv_dim, block_c),)](
        mixed, a, b, conv_state, conv_weight, A_log, dt_bias, x, q, k, v, g, beta,
        mixed.stride(1), a.stride(1), b.stride(1), x.stride(1), q.stride(1), v.stride(1),
        g.stride(1), tokens, KD=key_dim, CD=conv_dim, HV=value_heads,
        W=conv_weight.shape[1], BT=_pow2(tokens), BC=block_c,
        BH=triton.next_power_of_2(value_heads), NEG_EIGVAL=neg_eigval, num_warps=warps)


def names() -> tuple[str, ...]:
    return tuple(f"record@{bc}x{w}" for bc, w in TILES)


def _tile(name: str) -> tuple[int, int]:
    if name not in names():
        raise ValueError(f"gdn_block_record: kernel must be one of {', '.join(names())}, got "
                         f"{name!r}")
    return TILES[names().index(name)]


# The tape's buffers as the ops that write them name their arguments (declared mutated)
TAPE_ARGS = ("tape_x", "tape_q", "tape_k", "tape_v", "tape_g", "tape_beta")


@torch.library.custom_op("unimax::gdn_block_record", mutates_args=TAPE_ARGS)
def gdn_block_record(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, tape_x: torch.Tensor, tape_q: torch.Tensor,
                     tape_k: torch.Tensor, tape_v: torch.Tensor, tape_g: torch.Tensor,
                     tape_beta: torch.Tensor, neg_eigval: bool) -> None:
    """A recording mixer's conv, gates and tape over T tokens: one Triton kernel on CUDA (its
    tile per shape, timed once: ops.gemv.timed_choice), the torch forms elsewhere."""
    tape = (tape_x, tape_q, tape_k, tape_v, tape_g, tape_beta)
    args = (mixed, a, b, conv_state, conv_weight, A_log, dt_bias)
    check(mixed, a, b, conv_state, conv_weight, tape)
    if not (mixed.is_cuda and not _interpreted() and fla_ops() is not None):
        gdn_block_record_ref(*args, tape, neg_eigval)
        return
    key = (_pow2(mixed.shape[1]), mixed.shape[2], *tape_q.shape[2:], *tape_v.shape[2:],
           mixed.dtype, neg_eigval)  # (one compile per power of two of T: timed per bucket)

    def run(name: str, *tensors) -> None:
        launch(*tensors[:7], tensors[7:], neg_eigval, _tile(name))

    name = CHOICES.get(key) or timed_choice(CHOICES, key, names(), names()[1], True, run,
                                            (*args, *tape))
    run(name, *args, *tape)


@gdn_block_record.register_fake
def _(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, tape_x, tape_q, tape_k, tape_v,
      tape_g, tape_beta, neg_eigval):
    return None


def usable(mixed: torch.Tensor) -> bool:
    """Whether the op's kernel runs for this input (CUDA with fla's kernels importable: the
    same condition as the mixer's fla path)."""
    return mixed.is_cuda and fla_ops() is not None
