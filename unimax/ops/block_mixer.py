"""A recording GDN mixer's middle over a verify block as one op: the short convolution, the
gates, the tape's copies and the gated delta rule, ``gdn_block_record(mixed, a, b, conv_state,
conv_weight, A_log, dt_bias, recurrent_state, *tape, num_k_heads, neg_eigval) -> o``.

mixed (1, T, conv_dim) is the in-projection's [q | k | v] part before the convolution, a and b
(1, T, HV) its raw decay and write-strength inputs (views of the projection's output); the
states are read, not written (a recording forward leaves them to the rewind, unimax.tape); the
tape is the layer's (conv input, q, k, v, g, beta) buffers (unimax.tape.LayerTape), written for
the first T tokens. o (1, T, HV, V) in mixed's dtype.

Why: written as torch ops, this middle compiled to ~11 kernels per layer of the 4B verify
block (the block conv, q, k and v made contiguous, the gates, the tape's copies, the
recurrence), ~1.2 us each plus the gaps between launches, in a block of 778 launches and ~1.1
ms of small kernels and gaps (bench/RESULTS.md, thirteenth session). As this op it is one
Triton kernel (ops/short_recurrence_kernel.py: ``block_mixer_kernel``) that convolves each
program's own channels, writes the tape and runs the recurrence as ops.short_recurrence's
kernel does. Not yet measured on a GPU.

``gdn_block_record_ref`` is the twin (the mixer's torch forms), which the op runs off CUDA.
"""

from __future__ import annotations

import torch

from .conv import causal_conv1d
from .decode_step import decay, write_strength
from .gated_delta import fla_ops, gated_delta_rule
from .gemv import _interpreted, timed_choice
from .short_recurrence import _pow2

# (BV value columns per program, TC tokens per chunk held in registers), one warp each as
# ops.short_recurrence found best. The conv's tiles come on top of the recurrence's: compiled
# for sm_90 at 4B heads, 16-token chunks spilled 0.3-4 KB per thread, 8-token chunks 16-108
# bytes at BV 4 and 8, 4-token chunks nothing at BV 4 (ptxas -v); a chunk more costs one more
# round trip for its loads. The timed choice picks.
TILES = ((4, 8), (8, 8), (4, 4), (8, 4))
CHOICES: dict[tuple, str] = {}  # (T, conv_dim, H, HV, K, V, dtype, neg) -> "block@BVxTC"


def check(mixed, a, b, conv_state, conv_weight, recurrent_state, tape, num_k_heads: int) -> None:
    """Names what does not fit the kernel."""
    problems = []
    batch, tokens, conv_dim = mixed.shape
    value_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    if batch != 1:
        problems.append(f"one sequence, got {batch}")
    if conv_dim != 2 * num_k_heads * head_k_dim + value_heads * head_v_dim or \
            value_heads % num_k_heads:
        problems.append(f"mixed has {conv_dim} channels; {num_k_heads} key heads and the "
                        f"state's {value_heads} value heads of {head_k_dim} x {head_v_dim} do "
                        "not make that")
    if a.shape != (1, tokens, value_heads) or b.shape != (1, tokens, value_heads):
        problems.append(f"a and b must be {(1, tokens, value_heads)}")
    if conv_state.shape != (1, conv_dim, conv_weight.shape[1]) or \
            not conv_state.is_contiguous() or not conv_weight.is_contiguous():
        problems.append("conv_state (1, conv_dim, W) and conv_weight (conv_dim, W) must be "
                        "contiguous")
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        problems.append("recurrent_state must be contiguous fp32")
    if any(x.stride(-1) != 1 for x in (mixed, a, b)):
        problems.append("mixed, a and b must have contiguous channels")
    x, q, k, v, g, beta = tape
    if x.shape[1] < tokens or any(t.shape[0] != 1 or not t.is_contiguous() for t in tape):
        problems.append(f"the tape must be one layer's contiguous buffers of {tokens}+ tokens")
    if problems:
        raise ValueError("gdn_block_record: " + "; ".join(problems))


def gdn_block_record_ref(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state,
                         tape, num_k_heads: int, neg_eigval: bool) -> torch.Tensor:
    """The twin: the mixer's torch forms (its recording path, unimax.layers)."""
    tokens = mixed.shape[1]
    value_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    y, _ = causal_conv1d(mixed, conv_weight, conv_state)
    key_dim = num_k_heads * head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, value_heads * head_v_dim], dim=-1)
    q = q.reshape(1, tokens, num_k_heads, head_k_dim)
    k = k.reshape(1, tokens, num_k_heads, head_k_dim)
    v = v.reshape(1, tokens, value_heads, head_v_dim)
    beta, g = write_strength(b, neg_eigval), decay(a, A_log, dt_bias)
    for buffer, value in zip(tape, (mixed, q, k, v, g, beta), strict=True):
        buffer[:, :tokens].copy_(value)
    o, _ = gated_delta_rule(*(t[:, :tokens] for t in tape[1:]), recurrent_state,
                            backend="torch", final_state=False)
    return o


def launch(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, tape,
           num_k_heads: int, neg_eigval: bool, tile: tuple[int, int]) -> torch.Tensor:
    """The kernel at one tile (BV, TC) of TILES (CUDA, or Triton's interpreter)."""
    import triton

    from .short_recurrence_kernel import block_mixer_kernel

    tokens = mixed.shape[1]
    value_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    x, q, k, v, g, beta = tape
    o = mixed.new_empty(1, tokens, value_heads, head_v_dim)
    block_v, chunk = tile
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    block_mixer_kernel[(triton.cdiv(head_v_dim, block_v), value_heads)](
        mixed, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, o,
        x, q, k, v, g, beta, head_k_dim ** -0.5,
        mixed.stride(1), a.stride(1), b.stride(1), x.stride(1), q.stride(1), v.stride(1),
        g.stride(1), T=tokens, H=num_k_heads, HV=value_heads, K=head_k_dim, V=head_v_dim,
        W=conv_weight.shape[1], BK=triton.next_power_of_2(head_k_dim), BV=block_v,
        TC=min(chunk, _pow2(tokens)), NEG_EIGVAL=neg_eigval, num_warps=1)
    return o


def names() -> tuple[str, ...]:
    return tuple(f"block@{bv}x{tc}" for bv, tc in TILES)


def _tile(name: str) -> tuple[int, int]:
    if name not in names():
        raise ValueError(f"gdn_block_record: kernel must be one of {', '.join(names())}, got "
                         f"{name!r}")
    return TILES[names().index(name)]


@torch.library.custom_op("unimax::gdn_block_record",
                         mutates_args=("tape_x", "tape_q", "tape_k", "tape_v", "tape_g",
                                       "tape_beta"))
def gdn_block_record(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, recurrent_state: torch.Tensor,
                     tape_x: torch.Tensor, tape_q: torch.Tensor, tape_k: torch.Tensor,
                     tape_v: torch.Tensor, tape_g: torch.Tensor, tape_beta: torch.Tensor,
                     num_k_heads: int, neg_eigval: bool) -> torch.Tensor:
    """A recording mixer's conv, gates, tape and recurrence over T tokens: one Triton kernel on
    CUDA (its tile per shape, timed once: ops.gemv.timed_choice), the torch forms elsewhere."""
    tape = (tape_x, tape_q, tape_k, tape_v, tape_g, tape_beta)
    args = (mixed, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state)
    check(mixed, a, b, conv_state, conv_weight, recurrent_state, tape, num_k_heads)
    if not (mixed.is_cuda and not _interpreted() and fla_ops() is not None):
        # (contiguous, as the fake says: the chunked torch form's o is a transposed view)
        return gdn_block_record_ref(*args, tape, num_k_heads, neg_eigval).contiguous()
    key = (*mixed.shape[1:], num_k_heads, *recurrent_state.shape[1:], mixed.dtype, neg_eigval)

    def run(name: str, *tensors) -> torch.Tensor:
        return launch(*tensors[:8], tensors[8:], num_k_heads, neg_eigval, _tile(name))

    name = CHOICES.get(key) or timed_choice(CHOICES, key, names(), names()[1], True, run,
                                            (*args, *tape))
    return run(name, *args, *tape)


@gdn_block_record.register_fake
def _(mixed, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, tape_x, tape_q,
      tape_k, tape_v, tape_g, tape_beta, num_k_heads, neg_eigval):
    value_heads, _, head_v_dim = recurrent_state.shape[1:]
    return mixed.new_empty(1, mixed.shape[1], value_heads, head_v_dim)


def usable(mixed: torch.Tensor) -> bool:
    """Whether the op's kernel runs for this input (CUDA with fla's kernels importable: the
    same condition as the mixer's fla path)."""
    return mixed.is_cuda and fla_ops() is not None

