"""The gated delta rule over a few tokens (2 to SHORT_MAX, 33) on CUDA, as one op:
``short_gated_delta_rule(q, k, v, g, beta, initial_state, final_state) -> (o, state)``.

Who runs a few tokens: the verifier's block (k + 1 rows, every GDN layer), its rewind (all
layers at once, layers as the batch) and short prompts. fla's fused recurrent kernel loads each
token's inputs inside its time loop, so a token waits a memory round trip before its step: at
4B heads on the H200 its 9-token launches took ~14 us each in the verify block (33 launches,
0.56 ms of a 4.5 ms block, bench/RESULTS.md) where one token takes ~3.6.
Our kernel (short_recurrence_kernel.py) has fla's arithmetic but requests every token's inputs
before the first step.

Which kernel and launch (BV columns of V per program, warps, tokens per chunk) is a timed
choice (ops.gemv.timed_choice: graph-timed at warm-up, kept), fla's kernel among the
candidates: heads where ours is not faster keep fla's. Measured (H200, 4B heads, graph-timed
over input copies): 8.3 us against fla's 22.0 for the 9-token block, 13.5 against 40.1 for 17
tokens; the 32-layer rewind (16,384 one-warp programs) 122 against 123, a tie. The verifier
makes the heads' choice before anything else meets them (``choose_for_blocks``), timing each
candidate at a whole block's cost, its launches and its rewind: the rewind's best setting is
not the block's. Off CUDA the op runs the torch loop (``recurrent_gated_delta_rule_ref``), its
twin.

One choice per heads (not per batch, length or final-state flag), and the chunk of tokens
held in registers fixed by the launch setting: the verify block and the rewind must compute a
state bit for bit alike. An fp32 sum's rounding follows the kernel's register layout, which
follows the launch setting and the tile shapes; a state computed across another block
boundary, by another setting, rounds otherwise, and the verified stream then depends on where
its blocks were cut (bench/RESULTS.md: with a recurrence of its own in the
verify block the forced-acceptance bench saw 22 of 45 blocks rejected at a forced acceptance
of 1.0). For the same reason a choice first met while a graph is being captured keeps its
default (our kernel at 8 columns and 16-token chunks: the fastest at every 4B shape the H200
timed; on an H100, 8-token chunks ran a 9-token
block 0.4 us faster) rather than taking it for that graph only. The verifier's choice
(``choose_for_blocks``) is made before any capture, so the default is a fallback only.

Shapes as ops.gated_delta: q, k (B, T, H, K), v (B, T, HV, V), g, beta (B, T, HV), the state
(B, HV, K, V) fp32; each token's heads contiguous (batch and time may be strided: the tape's
views). ``final_state=False``: the state after the run is not computed (an empty tensor comes
back), as fla's ``output_final_state=False``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .choices import ChoiceTable
from .fla import fla_ops, fla_run
from .gated_delta_ref import recurrent_gated_delta_rule_ref
from .gemv import _interpreted, timed_choice

# tokens: a verify block of up to 32 drafts, and the short prompts' buckets of 16 and 32
# (longer runs keep fla's kernel: a step per token unrolled in the kernel, compiled per length)
SHORT_MAX = 33
# launch settings (BV, warps, TC: tokens whose inputs one program holds in registers at once)
# offered to the choice, beside fla's kernel. One warp a program, as fla launches its own: on
# the H200 at 4B heads (bench/RESULTS.md) BV 4 and 8 on one warp with TC 16
# took 8.3-8.6 us for 9 tokens (fla's kernel 22.0) and 13.5 for 17 (40.1); every setting with 2
# to 8 warps was 2-6x slower than those (the per-step row picks and sums cross warps). Each
# step picks its token's q, k and v out of the chunk's registers by a masked sum over the
# chunk, work in proportion to TC: chunks of 8 and 4 tokens halve and quarter it for one more
# round trip of loads per chunk (H100: TC 8 the fastest for 9- and
# 17-token blocks at 0.8B and 4B heads, e.g. 6.3 us at 4x1x8 against 7.0 at 4x1x16). The chunk is
# the setting's, never the length's: see the module's docstring. Tried and dropped (H100,
# bench/RESULTS.md): each step loading its own token's vectors, the
# outputs stored after the last step ("direct"): 9.4-10.4 us for a 9-token block against 6.3
# at short@4x1x8 (0.8B heads) and 9.6-10.7 against 8.1 (4B heads); faster only for the
# 32-layer rewind (105 against 120 us at 4B heads), which must share the block's setting.
TILES = ((4, 1, 16), (8, 1, 16), (16, 1, 16), (4, 1, 8), (8, 1, 8), (4, 1, 4), (8, 1, 4))
CHOICES = ChoiceTable("short_recurrence")  # (H, K, HV, V, dtype, no state?) -> a name
DEFAULT = "short@8x1x16"


def names() -> tuple[str, ...]:
    return ("fla",) + tuple(f"short@{bv}x{w}x{tc}" for bv, w, tc in TILES)


def parse(name: str) -> tuple[int, int, int] | None:
    """"short@BVxWxTC" -> (BV, warps, TC); "fla" -> None."""
    if name == "fla":
        return None
    form, _, tile = name.partition("@")
    parts = tuple(int(p) for p in tile.split("x")) if form == "short" else ()
    if parts not in TILES:
        raise ValueError(f"short recurrence: kernel must be 'fla' or one of "
                         f"{', '.join(names()[1:])}, got {name!r}")
    return parts


def check(q, k, v, g, beta, initial_state) -> None:
    """Names what does not fit the kernels."""
    problems = []
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        problems.append(f"q, k must be (B, T, H, K) and v (B, T, HV, V), got {tuple(q.shape)}, "
                        f"{tuple(k.shape)}, {tuple(v.shape)}")
    elif v.shape[2] % q.shape[2]:
        problems.append(f"value heads ({v.shape[2]}) must be a multiple of key heads "
                        f"({q.shape[2]})")
    elif g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        problems.append(f"g and beta must be {tuple(v.shape[:3])}, got {tuple(g.shape)} and "
                        f"{tuple(beta.shape)}")
    if not 1 <= q.shape[1] <= SHORT_MAX:
        problems.append(f"1 to {SHORT_MAX} tokens, got {q.shape[1]}")
    if initial_state is not None and (
            initial_state.dtype != torch.float32 or not initial_state.is_contiguous()
            or initial_state.shape != (v.shape[0], v.shape[2], q.shape[3], v.shape[3])):
        problems.append(f"initial_state must be contiguous fp32 "
                        f"{(v.shape[0], v.shape[2], q.shape[3], v.shape[3])}")
    if problems:
        raise ValueError("short_gated_delta_rule: " + "; ".join(problems))


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with each token's (heads, features) contiguous, as the kernel indexes them."""
    inner_ok = x.stride(-1) == 1 and (x.dim() < 4 or x.stride(-2) == x.shape[-1])
    return x if inner_ok else x.contiguous()


def launch_short(q, k, v, g, beta, initial_state, final_state: bool, block_v: int,
                 num_warps: int, chunk: int, *, out: torch.Tensor | None = None,
                 save: torch.Tensor | None = None, copy: torch.Tensor | None = None,
                 outputs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Our kernel at one launch setting (CUDA, or Triton's interpreter). ``out``: the final
    state's storage (may be ``initial_state`` itself: in place), ``save``: where the initial
    state is kept, ``copy``: a second store of the final state (all contiguous fp32, the
    state's shape; rewind_states_ checks them). ``outputs=False``: o is not computed (an empty
    tensor comes back; the states are the same bit for bit)."""
    from .short_recurrence_kernel import short_recurrence_kernel

    batch, tokens, num_k_heads, head_k_dim = q.shape
    value_heads, head_v_dim = v.shape[2:]
    q, k, v = _heads_contiguous(q), _heads_contiguous(k), _heads_contiguous(v)
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    if initial_state is None:
        initial_state = v.new_zeros(batch, value_heads, head_k_dim, head_v_dim,
                                    dtype=torch.float32)
    o = v.new_empty(batch, tokens, value_heads, head_v_dim) if outputs else v.new_empty(0)
    if not final_state:
        state = initial_state.new_empty(0)
    else:
        state = torch.empty_like(initial_state) if out is None else out
    consts = constants((block_v, num_warps, chunk), tokens, head_k_dim, head_v_dim)
    grid = (-(-head_v_dim // consts["BV"]), batch * value_heads)
    short_recurrence_kernel[grid](
        q, k, v, g, beta, o, initial_state, state if final_state else initial_state,
        initial_state if save is None else save, initial_state if copy is None else copy,
        head_k_dim ** -0.5, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        H=num_k_heads, HV=value_heads, K=head_k_dim, V=head_v_dim, STORE_FINAL=final_state,
        SAVE_INITIAL=save is not None, STORE_COPY=copy is not None, STORE_O=outputs,
        num_warps=num_warps, **consts)
    return o, state


def constants(tile: tuple[int, int, int], tokens: int, head_k_dim: int,
              head_v_dim: int) -> dict:
    """The kernel's tile constants at a launch setting for a run of ``tokens``: the chunk is
    the setting's whatever the length (a chunk of the length's own size would change the
    kernel's register layout with it, and the block's and the rewind's states would round
    apart: see the module's docstring). Also what the layout test compiles with."""
    block_v, _, chunk = tile
    return dict(T=tokens, BK=_pow2(head_k_dim), BV=min(block_v, _pow2(head_v_dim)), TC=chunk)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def launch_fla(q, k, v, g, beta, initial_state, final_state: bool):
    """fla's fused recurrent kernel, as ops.gated_delta launches it."""
    o, state = fla_run(fla_ops()[1], q, k, v, g, beta, initial_state, final_state)
    return o, (state if final_state else q.new_empty(0, dtype=torch.float32))


def run(name: str, q, k, v, g, beta, initial_state, final_state: bool):
    tile = parse(name)
    if tile is None:
        return launch_fla(q, k, v, g, beta, initial_state, final_state)
    return launch_short(q, k, v, g, beta, initial_state, final_state, *tile)


def choose(q, k, v, g, beta, initial_state, final_state: bool) -> str:
    """The fastest of fla's kernel and ours at each launch setting for these heads, timed once
    at their first call, whatever its length (ops.gemv.timed_choice; DEFAULT, kept, where it
    cannot be timed)."""
    key = (*q.shape[2:], *v.shape[2:], q.dtype, initial_state is None)
    if key in CHOICES:
        return CHOICES[key]
    return timed_choice(CHOICES, key, names(), DEFAULT, q.is_cuda,
                        lambda name, *tensors: run(name, *tensors, final_state),
                        (q, k, v, g, beta, initial_state), keep_default=True)


def rewind_states_(q, k, v, g, beta, state: torch.Tensor, saved: torch.Tensor,
                   copy: torch.Tensor) -> bool:
    """The verifier's rewind as one pass over the GDN states: ``saved`` <- ``state`` (the state
    before the block, which Engine._finish restores when a stop cuts the block), then
    ``state`` and ``copy`` (the draft's) <- the state after the run from it. In steps that is a
    67 MB snapshot before the block, the recurrence into a new tensor, a copy of it into the
    cache and one into the draft's cache (at 4B); here the states are read once and written
    three times, and the outputs, which a rewind does not read, are not computed. Where our
    kernel does not run these heads (off CUDA, or fla's kernel chosen for them, whose rounding
    the block's forward then has), nothing is done and False comes back: the caller runs
    those steps (GDNForCausalLM.rewind_unchecked)."""
    if not (q.is_cuda and not _interpreted() and available() and q.shape[1] <= SHORT_MAX):
        return False
    check(q, k, v, g, beta, state)
    for name, other in (("saved", saved), ("copy", copy)):
        if (other.shape != state.shape or other.dtype != state.dtype
                or not other.is_contiguous() or other.data_ptr() == state.data_ptr()):
            raise ValueError(f"rewind_states_: {name} must be a contiguous fp32 tensor of the "
                             f"state's shape {tuple(state.shape)} in storage of its own")
    g = g.float()
    tile = parse(choose(q, k, v, g, beta, state, True))
    if tile is None:
        return False
    launch_short(q, k, v, g, beta, state, True, *tile, out=state, save=saved, copy=copy,
                 outputs=False)
    return True


def random_run(batch: int, tokens: int, heads: tuple[int, int, int, int], dtype: torch.dtype,
               generator: torch.Generator, rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """Random inputs of the op for ``heads`` (H, K, HV, V): q, k, v in ``dtype``, the log-decay
    g in (-1, 0] (fp32), beta in [0, 1) in ``dtype`` and an fp32 state, on the generator's
    device. ``rows`` > tokens: q, k and v are the first ``tokens`` rows of longer buffers,
    strided as the tape's views are. For timing launch settings (``choose_for_blocks``),
    bench/rewind.py and the GPU tests."""
    num_k_heads, head_k_dim, num_v_heads, head_v_dim = heads
    device, rows = generator.device, rows or tokens

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    q, k = (randn(batch, rows, num_k_heads, head_k_dim).to(dtype)[:, :tokens] for _ in range(2))
    v = randn(batch, rows, num_v_heads, head_v_dim).to(dtype)[:, :tokens]
    g = -torch.rand(batch, tokens, num_v_heads, device=device, generator=generator)
    beta = torch.rand(batch, tokens, num_v_heads, device=device, generator=generator).to(dtype)
    return q, k, v, g, beta, randn(batch, num_v_heads, head_k_dim, head_v_dim)


def choose_for_blocks(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                      dtype: torch.dtype, layers: int, span: int,
                      device: torch.device) -> str | None:
    """The heads' choice, made for the verifier before anything else meets them: each
    candidate timed at what a verify block of ``span`` tokens costs it, ``layers`` launches
    of one sequence (no final state) and the block's rewind (one launch, the layers as the
    batch: ``rewind_states_``; fla's kernel: the rewind's steps). Timed per call, as ``choose``
    does at the first call it meets, the block alone decides, and the rewind pays for it:
    at 4B heads on the H200 the one-pass rewind took 246 us at the batch-1 choice
    short@4x1x8 and 118 at short@8x1x8 (bench/rewind.py), where the
    9-token block's launches differ by well under 1 us. A key already chosen keeps its choice
    (graphs may hold it); off CUDA, None."""
    key = (num_k_heads, head_k_dim, num_v_heads, head_v_dim, dtype, False)
    if key in CHOICES:
        return CHOICES[key]
    if device.type != "cuda" or _interpreted() or not available() or span > SHORT_MAX:
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    heads = (num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    *block, block_state = random_run(1, span, heads, dtype, gen)
    *rewind, state = random_run(layers, span, heads, dtype, gen)
    saved, copy = torch.zeros_like(state), torch.zeros_like(state)

    def verify_block(name: str) -> None:
        for _ in range(layers):
            run(name, *block, block_state, False)
        tile = parse(name)
        if tile is None:  # (fla's kernel: rewind_states_ leaves the steps to the caller)
            saved.copy_(state)
            _, new = launch_fla(*rewind, saved, True)
            state.copy_(new)
            copy.copy_(new)
        else:
            launch_short(*rewind, state, True, *tile, out=state, save=saved, copy=copy,
                         outputs=False)

    return timed_choice(CHOICES, key, names(), DEFAULT, True, verify_block, keep_default=True)


@functools.cache
def available() -> bool:
    """Whether the CUDA kernels can run here (Triton and fla importable)."""
    return fla_ops() is not None


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::short_gated_delta_rule", mutates_args=())
def short_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor,
                           initial_state: Optional[torch.Tensor],  # noqa: UP045
                           final_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over 1 to SHORT_MAX tokens: the chosen kernel on CUDA, the torch
    loop elsewhere. Returns (o in v's dtype, the final state or an empty tensor)."""
    check(q, k, v, g, beta, initial_state)
    g = g.float()
    if q.is_cuda and not _interpreted() and available():
        return run(choose(q, k, v, g, beta, initial_state, final_state), q, k, v, g, beta,
                   initial_state, final_state)
    o, state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state)
    return o, (state if final_state else q.new_empty(0, dtype=torch.float32))


@short_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, final_state):
    batch, tokens, value_heads, head_v_dim = v.shape
    state = (q.new_empty(batch, value_heads, q.shape[3], head_v_dim, dtype=torch.float32)
             if final_state else q.new_empty(0, dtype=torch.float32))
    return v.new_empty(batch, tokens, value_heads, head_v_dim), state
