"""A one-token FP8 MLP block as one launch (the draft's; off until timed on a GPU):
out = x + down(silu(gate) * up), [gate; up] = gate_up(RMSNorm(x)), for x (1, H).

The fused draft step (unimax.fused_draft) runs this block as two fused GEMVs, gate-up with the
RMS prologue and down with the SwiGLU prologue and the residual; each pays a GEMV's fixed cost
(~2.5 us of read latency and ~1.5 us of structure on the H200, docs/design.md) one after the
other. Here one kernel (fused_mlp_kernel.py) issues both halves' weight loads per program and
pays it once. Its down-projection is split over the intermediate units, the programs' partial
rows added with fp32 atomics: their order varies from launch to launch, so the sums may differ
in fp32's last bits and the rounded output by a BF16 ulp now and then. Hence for verified
mode's draft only (the exact model checks every token it proposes); FP8 speed mode, whose
tokens are its output, keeps the two GEMVs. The twin is that pair's own twin
(``fused_mlp_ref``).

The op (``fused_mlp_step``) times the kernel at each of its TILES against the pair per shape
in graphs, as the GEMVs' forms are timed, and runs the fastest: where one launch does not pay,
the draft runs the pair as before. ``FUSED_MLP`` (off): whether unimax.fused_draft runs a
verified draft's MLPs through this op.
"""

from __future__ import annotations

import torch

from .fused_gemv import fused_small_m_linear, fused_small_m_linear_ref, pdl_launch
from .gemv import _interpreted, tiled_names, timed_choice

FUSED_MLP = False
# The kernel's tiles (BLOCK_R: intermediate units a program, its gate and up rows and its down
# columns; BLOCK_K: gate-up's K tile; BLOCK_H: down's output tile; warps), the first the
# default; each offered to the per-shape timed choice, with "pair" (the two fused GEMVs).
TILES = ((16, 256, 256, 4), (32, 256, 128, 4), (32, 128, 256, 8), (8, 512, 256, 4))
CHOICES: dict[tuple, str] = {}  # (hidden, inter, weight dtype) -> "pair" or "one@tile"
_ROWS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, H) -> (fp32 row, counter)


def fused_mlp_ref(x, gate_up_w, gate_up_s, down_w, down_s, hidden: int, inter: int,
                  norm_weight, eps: float, offset: float) -> torch.Tensor:
    """The twin: the unfused pair's twins (gate-up with the RMS prologue, then down with the
    SwiGLU prologue and x as the residual)."""
    gate_up = fused_small_m_linear_ref(x, gate_up_w, gate_up_s, 2 * inter, hidden, "rms",
                                       norm_weight, eps=eps, offset=offset)
    return fused_small_m_linear_ref(gate_up, down_w, down_s, hidden, inter, "swiglu",
                                    residual=x)


def _row(device: torch.device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's fp32 row and counter for this device and hidden size: zero between
    launches (each launch's last program zeroes them), so shared by every layer of a step,
    which run one after another on one stream. Like split-K's counters (ops.gemv._counters),
    two launches must not run at once on two streams: UNI MAX's forwards run on one."""
    key = (str(device), hidden)
    if key not in _ROWS:
        _ROWS[key] = (torch.zeros(hidden, device=device, dtype=torch.float32),
                      torch.zeros(1, device=device, dtype=torch.int32))
    return _ROWS[key]


def check(x, gate_up_w, gate_up_s, down_w, down_s, hidden: int, inter: int) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != hidden:
        raise ValueError(f"fused_mlp: x must be one row of {hidden}, got {tuple(x.shape)}")
    if gate_up_w.shape[0] < 2 * inter or gate_up_w.shape[1] < hidden:
        raise ValueError(f"fused_mlp: gate_up weight {tuple(gate_up_w.shape)} is smaller than "
                         f"({2 * inter}, {hidden})")
    if down_w.shape[0] < hidden or down_w.shape[1] < inter:
        raise ValueError(f"fused_mlp: down weight {tuple(down_w.shape)} is smaller than "
                         f"({hidden}, {inter})")
    if gate_up_s is None or down_s is None:
        raise ValueError("fused_mlp: FP8 weights with per-row scales only")


def fused_mlp(x: torch.Tensor, gate_up_w: torch.Tensor, gate_up_s: torch.Tensor,
              down_w: torch.Tensor, down_s: torch.Tensor, hidden: int, inter: int,
              norm_weight: torch.Tensor, eps: float, offset: float = 0.0,
              tile: tuple[int, int, int, int] = TILES[0]) -> torch.Tensor:
    """x (1, hidden) -> x + down(silu(gate) * up) of RMSNorm(x) (module docstring): the kernel
    at ``tile`` (one of TILES) on CUDA and in Triton's interpreter, the twin elsewhere. Weights
    may be padded past (2 inter, hidden) and (hidden, inter), as an FP8Linear's are."""
    check(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter)
    if tile not in TILES:
        raise ValueError(f"fused_mlp: tile {tile} is not one of {TILES}")
    if not (x.is_cuda or _interpreted()):
        return fused_mlp_ref(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter,
                             norm_weight, eps, offset)
    import triton

    from .fused_mlp_kernel import fused_mlp_kernel

    x = x.contiguous()
    y = torch.empty_like(x)
    row, counter = _row(x.device, hidden)
    units, block_k, block_h, warps = tile
    fused_mlp_kernel[(triton.cdiv(inter, units),)](
        x, norm_weight, gate_up_w, gate_up_s, down_w, down_s, y, row, counter, hidden, inter,
        gate_up_w.stride(0), down_w.stride(0), eps, offset,
        HP=triton.next_power_of_2(hidden), BLOCK_R=units, BLOCK_K=block_k, BLOCK_H=block_h,
        num_warps=warps,
        **pdl_launch(x, gate_up_w))  # (the draft's timed PDL setting and signal, as its GEMVs)
    return y


def run_named(name: str, x, gate_up_w, gate_up_s, down_w, down_s, hidden: int, inter: int,
              norm_weight, eps: float, offset: float) -> torch.Tensor:
    """The block by a choice's name: "pair" (the two fused GEMVs, as without this op) or
    "one@RxKxHxW" (the kernel at that tile)."""
    if name == "pair":
        gate_up = fused_small_m_linear(x, gate_up_w, gate_up_s, 2 * inter, hidden, "rms",
                                       norm_weight, None, None, eps, offset)
        return fused_small_m_linear(gate_up, down_w, down_s, hidden, inter, "swiglu", None,
                                    None, x, 1e-6, 0.0)
    form, _, named = name.partition("@")
    tile = tuple(int(v) for v in named.split("x")) if named else None
    if form != "one" or tile not in TILES:
        raise ValueError(f"fused_mlp: kernel must be 'pair' or one@tile with a tile of "
                         f"{TILES}, got {name!r}")
    return fused_mlp(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter, norm_weight, eps,
                     offset, tile)


def names() -> tuple[str, ...]:
    return ("pair", *tiled_names(("one",), {"one": TILES}))


def choose(x, gate_up_w, gate_up_s, down_w, down_s, hidden: int, inter: int, norm_weight,
           eps: float, offset: float) -> str:
    """The fastest of the pair and the kernel's tiles for this shape, timed once in graphs
    (ops.gemv.timed_choice, over weight copies L2 cannot hold, in the PDL setting the caller
    runs in); the pair where it cannot be timed (off CUDA, first met inside a capture). The
    pair runs once first, so that its own GEMVs' choices are made before the timing."""
    key = (hidden, inter, gate_up_w.dtype)
    if key in CHOICES:  # (every call after the first: no names to build)
        return CHOICES[key]
    if x.is_cuda and not torch.cuda.is_current_stream_capturing():
        run_named("pair", x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter,
                  norm_weight, eps, offset)
    return timed_choice(
        CHOICES, key, names(), "pair", x.is_cuda,
        lambda name, gw, gs, dw, ds: run_named(name, x, gw, gs, dw, ds, hidden, inter,
                                                norm_weight, eps, offset),
        (gate_up_w, gate_up_s, down_w, down_s))


@torch.library.custom_op("unimax::fused_mlp_step", mutates_args=())
def fused_mlp_step(x: torch.Tensor, gate_up_w: torch.Tensor, gate_up_s: torch.Tensor,
                   down_w: torch.Tensor, down_s: torch.Tensor, hidden: int, inter: int,
                   norm_weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """The block as an op for the compiled step (no graph break): on CUDA the per-shape timed
    choice between the one-launch kernel at its tiles and the two fused GEMVs (``choose``),
    so it runs only where faster; ``fused_mlp`` (its twin) elsewhere."""
    if not x.is_cuda:
        return fused_mlp(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter, norm_weight,
                         eps, offset)
    check(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter)
    name = choose(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter, norm_weight, eps,
                  offset)
    return run_named(name, x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter, norm_weight,
                     eps, offset)


@fused_mlp_step.register_fake
def _(x, gate_up_w, gate_up_s, down_w, down_s, hidden, inter, norm_weight, eps, offset):
    return x.new_empty(x.shape)


def mark_view(view) -> int:
    """Mark a full FP8 draft view's fused blocks (unimax.fused_draft) to run their MLPs through
    this op where ``FUSED_MLP`` is on now (read once: an A/B builds a second engine); returns
    how many. unimax.build calls it for verified mode's full draft only."""
    count = 0
    for block in getattr(view, "layers", ()):
        block.mlp_one_launch = bool(FUSED_MLP and getattr(block, "fused", False))
        if block.mlp_one_launch:  # (its row made now, never inside a graph's capture)
            gate_up = block.mlp.gate_up_proj
            _row(gate_up.weight.device, gate_up.in_features)
        count += block.mlp_one_launch
    return count
