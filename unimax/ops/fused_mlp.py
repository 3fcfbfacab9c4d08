"""A one-token decode step's SwiGLU MLP with its norm and residual add as one op, for the
full-FP8 draft (unimax.fused_draft): ``fused_mlp(x, norm_weight, gate_up, gate_up_scale, down,
down_scale, intermediate, eps, offset) -> x + down(silu(gate) * up)``, [gate; up] =
gate_up(RMSNorm(x)).

Why: the draft folds each MLP into two fused GEMVs (ops.fused_gemv: "rms" into gate_up, then
"swiglu" with the residual into down), and each GEMV launch pays ~2.5-4 us that its bytes do
not need (a kernel that only reads has ~2.5 us of fixed cost on the H200: bench/small_reads.py;
the 4B draft's 128 GEMVs hold ~540 us over their bytes' time, bench/RESULTS.md, thirty-second
session). That fixed cost is what keeps the 4B draft step at 0.63-0.66 of a BF16 step where its
bytes say 0.5. Here the down-projection runs inside the gate_up GEMV: a program that owns
BLOCK_I intermediate channels already holds their hidden values, so it multiplies them by the
down-projection's columns of those channels (a split-K GEMV whose slices are the programs'
channels) and adds the partial sums into an fp32 workspace with atomics; the last program to
arrive finishes the output (``fused_mlp_kernel``). One launch per MLP instead of two, and the
hidden activation never goes through memory.

The sums of the down-projection land in the order the atomics do, so its output's last bit can
vary from run to run: the op is for the full draft only (unimax.fused_draft marks its blocks),
whose tokens the exact model checks, never for BF16-only or the FP8 tail, whose greedy output
should repeat exactly.

Which form runs is a timed choice per shape (ops.gemv.timed_choice, in graphs): "apart" (the
two fused GEMVs at their own chosen kernels, where things stood) or the kernel at one of its
tiles (``OFFERED``). ``fused_mlp_ref`` is the twin (the fused GEMVs' twins in turn), which the
op runs off CUDA.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fused_gemv import fused_small_m_linear, fused_small_m_linear_ref, pdl_launch, tma_problem
from .gemv import PROGRAM_ROWS, _interpreted, parse_kernel, tile_text, timed_choice

# Whether a full draft's blocks take this op (unimax.fused_draft; read per call).
FOLD = True
CHOICES: dict[tuple, str] = {}  # (M, hidden, intermediate, weight dtype) -> a name

# The kernel's tiles: (BLOCK_I intermediate channels a program, BLOCK_K of the gate_up loop,
# BLOCK_N of the down loop, warps) and for the TMA forms the pipeline's stages. "16": FP16
# products (FP8 weights only, as ops.gemv's rows16); "t": the down tile transposed before its
# sums (the kernel's DOWN_T).
PLAIN_TILES = ((32, 256, 256, 4), (64, 128, 128, 8), (64, 256, 128, 8), (16, 256, 256, 4))
TMA_TILES = ((32, 256, 256, 4, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3),
             (32, 128, 256, 4, 4), (16, 256, 256, 4, 3))
TILES = {"mlp": PLAIN_TILES, "mlp16": PLAIN_TILES, "tma": TMA_TILES, "tma16": TMA_TILES,
         "mlp16t": PLAIN_TILES, "tma16t": TMA_TILES}
# What the timed choice is given besides "apart" (each one a Triton compile per shape at
# warm-up).
OFFERED = tuple(f"{form}@{tile_text(tile)}" for form in TILES for tile in TILES[form])


def check(x, norm_weight, gate_up, down, intermediate: int) -> None:
    """Names what does not fit (the kernel reads by these shapes and strides)."""
    problems = []
    if x.dim() != 2 or x.stride(1) != 1 or not 0 < x.shape[0] <= PROGRAM_ROWS:
        problems.append(f"x must be (M, hidden) with 1 to {PROGRAM_ROWS} contiguous rows, got "
                        f"{tuple(x.shape)}")
    hidden = x.shape[-1]
    if norm_weight.shape != (hidden,):
        problems.append(f"norm_weight must be ({hidden},), got {tuple(norm_weight.shape)}")
    if gate_up.dim() != 2 or gate_up.shape[0] < 2 * intermediate or gate_up.shape[1] < hidden \
            or gate_up.stride(1) != 1:
        problems.append(f"gate_up {tuple(gate_up.shape)} must hold ({2 * intermediate}, "
                        f"{hidden}) with contiguous rows")
    if down.dim() != 2 or down.shape[0] < hidden or down.shape[1] < intermediate or \
            down.stride(1) != 1:
        problems.append(f"down {tuple(down.shape)} must hold ({hidden}, {intermediate}) with "
                        "contiguous rows")
    if problems:
        raise ValueError("fused_mlp: " + "; ".join(problems))


def fused_mlp_ref(x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate: int,
                  eps: float, offset: float) -> torch.Tensor:
    """The twin: the two fused GEMVs' twins (RMSNorm into gate_up, SwiGLU into down with the
    residual)."""
    hidden = x.shape[1]
    gu = fused_small_m_linear_ref(x, gate_up, gate_up_scale, 2 * intermediate, hidden, "rms",
                                  norm_weight, eps=eps, offset=offset)
    return fused_small_m_linear_ref(gu, down, down_scale, hidden, intermediate, "swiglu",
                                    residual=x)


def apart(x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate: int,
          eps: float, offset: float) -> torch.Tensor:
    """The two fused GEMVs as the draft ran them before this op (each its own timed choice)."""
    hidden = x.shape[1]
    gu = fused_small_m_linear(x, gate_up, gate_up_scale, 2 * intermediate, hidden, "rms",
                              norm_weight, None, None, eps, offset)
    return fused_small_m_linear(gu, down, down_scale, hidden, intermediate, "swiglu", None,
                                None, x, eps, offset)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's fp32 sums (PROGRAM_ROWS, hidden) and arrival counters (PROGRAM_ROWS,),
    zero between launches (the last program sets them back): one pair per device and width,
    made at first use, which must not be inside a CUDA graph capture (``launch`` checks).
    Shared, so launches must not run concurrently on two streams (as split-K's counters:
    ops.gemv._counters): UNI MAX runs one engine thread, its forwards on one stream."""
    key = (device, hidden)
    if key not in _WORKSPACES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_mlp: its workspace is made at first use, which must come "
                               "before a CUDA graph capture (run the op once first)")
        _WORKSPACES[key] = (torch.zeros(PROGRAM_ROWS, hidden, dtype=torch.float32,
                                        device=device),
                            torch.zeros(PROGRAM_ROWS, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def launch(x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate: int,
           eps: float, offset: float, kernel: str, atomics: bool = True) -> torch.Tensor:
    """The kernel by name, "form@tile" (CUDA, or Triton's interpreter); the twin's contract.
    ``atomics`` False drops the down-projection's partial sums (y is then wrong): for
    bench/fused_mlp.py, to tell what the atomics cost."""
    import triton

    from .fused_mlp_kernel import fused_mlp_kernel

    check(x, norm_weight, gate_up, down, intermediate)
    form, tile = parse_kernel(kernel, TILES, "fused_mlp")
    if tile is None:
        raise ValueError(f"fused_mlp: name a tile, one of {', '.join(OFFERED)}")
    scaled = gate_up_scale is not None
    f16 = "16" in form
    if f16 and not scaled:
        raise ValueError(f"fused_mlp: {form} (FP16 products) is for FP8 weights only")
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("fused_mlp: both weights FP8 with scales, or neither")
    m, hidden = x.shape
    acc, counters = _workspace(x.device, hidden)
    block_i, block_k, block_n, warps, *stages = tile
    tma = form.startswith("tma")
    wgu, wd = gate_up, down
    if tma:
        problem = tma_problem(gate_up, x) or tma_problem(down, x)
        if problem:
            raise ValueError(f"fused_mlp: {kernel}: {problem}; take an mlp form")
        from triton.tools.tensor_descriptor import TensorDescriptor

        wgu = TensorDescriptor(gate_up, [2 * intermediate, hidden], [gate_up.stride(0), 1],
                               [block_i, block_k])
        wd = TensorDescriptor(down, [hidden, intermediate], [down.stride(0), 1],
                              [block_n, block_i])
    y = torch.empty_like(x)
    fused_mlp_kernel[(triton.cdiv(intermediate, block_i), m)](
        x, norm_weight, wgu, gate_up_scale if scaled else x, wd, down_scale if scaled else x,
        y, acc, counters, hidden, intermediate, x.stride(0), gate_up.stride(0), down.stride(0),
        y.stride(0), eps, offset, KP=triton.next_power_of_2(hidden), HAS_SCALE=scaled,
        BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_N=block_n, F16=f16, TMA=tma,
        DOWN_T=form.endswith("t"), ATOMICS=atomics,
        STAGES=stages[0] if stages else 1, num_warps=warps, **pdl_launch(x, gate_up))
    return y


def candidates(x: torch.Tensor, gate_up: torch.Tensor, scaled: bool) -> tuple[str, ...]:
    """What the per-shape choice times: "apart" and the OFFERED forms that fit (FP16 products
    for FP8 weights only; TMA where W's layout and the device allow, ``tma_problem``)."""
    tma = tma_problem(gate_up, x) is None
    return ("apart", *(name for name in OFFERED
                       if (scaled or "16" not in name.split("@")[0])
                       and (tma or not name.startswith("tma"))))


def run(name: str, x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate: int,
        eps: float, offset: float) -> torch.Tensor:
    """One form by name: "apart" or the kernel ("form@tile")."""
    args = (x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate, eps, offset)
    return apart(*args) if name == "apart" else launch(*args, kernel=name)


# (Optional, not "| None": torch reads the op's schema from these annotations)
@torch.library.custom_op("unimax::fused_mlp", mutates_args=())
def fused_mlp(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: torch.Tensor,
              gate_up_scale: Optional[torch.Tensor], down: torch.Tensor,  # noqa: UP045
              down_scale: Optional[torch.Tensor], intermediate: int,  # noqa: UP045
              eps: float, offset: float) -> torch.Tensor:
    """x (M <= PROGRAM_ROWS, hidden) + down(silu(gate) * up) of gate_up(RMSNorm(x)): the
    chosen form on CUDA (timed once per shape), the twin elsewhere."""
    check(x, norm_weight, gate_up, down, intermediate)
    args = (norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate, eps, offset)
    if not x.is_cuda:
        return fused_mlp_ref(x, *args)
    key = (*x.shape, intermediate, gate_up.dtype)
    if key not in CHOICES and not torch.cuda.is_current_stream_capturing() and \
            not _interpreted():
        # "apart" once first: its GEMVs' own choices made here, not inside the timing's graphs
        # (where a first-met choice takes its default)
        apart(x, *args)
    name = CHOICES.get(key) or timed_choice(
        CHOICES, key, candidates(x, gate_up, gate_up_scale is not None), "apart", True,
        lambda name, gu, gus, d, ds: run(name, x, norm_weight, gu, gus, d, ds, intermediate,
                                         eps, offset),
        (gate_up, gate_up_scale, down, down_scale))
    return run(name, x, *args)


@fused_mlp.register_fake
def _(x, norm_weight, gate_up, gate_up_scale, down, down_scale, intermediate, eps, offset):
    return torch.empty_like(x)
