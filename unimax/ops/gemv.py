"""Linears at decode's few rows: y = x @ (W * s)^T for M <= GEMV_ROWS rows of x, W (N, K) in
BF16 or FP8 (float8_e4m3fn, with one fp32 scale per output row), activations never quantized.

At batch 1 a decode step's linears are matrix-vector products and a verifier block's are
k-row products: the time is reading W. cuBLAS picks GEMM tiles built for larger M: on the H200
it read the 248k-row LM head in FP8 (``torch._scaled_mm``, which first quantizes the activation)
barely faster than in BF16, and a compiled GDN step's BF16 projections at 1.4-2 TB/s of the
card's ~4 (bench/RESULTS.md). Triton kernels (ops/gemv_kernels.py) stream the rows of W
once and accumulate in fp32: "rows", where each row of x (M <= 4) is a program of its own (a
GEMV: the re-reads hit L2), and "dot", where one program multiplies all rows of x (padded to 16
or 32: ``dot_rows``) with a tile of W on the tensor cores. (A split-K GEMV, K in slices for the
K-long matrices, was measured slower than "rows" on every 4B shape and removed:
bench/RESULTS.md.)

``small_m_linear`` is a torch custom op (``unimax::small_m_linear``) with a fake kernel, so a
compiled step traces through it without a graph break. It also chooses, once per shape at first
use (the warm-up before a graph is captured), the fastest of the kernels that fit that M and
weight (``candidates``: cuBLAS too for BF16), timed as a step runs them: back to back in a
captured graph, over copies of the weight that L2 cannot hold (ops.timing). ``gemv_ref`` is the
plain-torch twin.
"""

import functools
import math
import time
from typing import Optional

import torch

from . import choices
from .pdl import pdl_launch
from .timing import graph_us, weight_copies
from .timing import interpreted as _interpreted

# Rows sent through these kernels (decode steps, verifier blocks); more: cuBLAS. 32 so that a
# block_size-16 verifier's 17-row forward has the tensor-core kernel among its timed choices too
# (it went to cuBLAS: verifying 16 drafts cost 1.59 BF16 steps at 4B on the H200, 8 drafts in 9
# rows 1.30-1.33; bench/RESULTS.md).
GEMV_ROWS = 32
PROGRAM_ROWS = 4  # up to this many rows: one program per row (the GEMV kernel)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), weight (N, K), scale (N,) fp32 or None -> (M, N) in x's dtype."""
    y = x.float() @ weight.float().t()
    if scale is not None:
        y = y * scale[None, :]
    return y.to(x.dtype)


# The GEMV's autotuned tiles (BLOCK_N, BLOCK_K, warps); the fused GEMVs (ops/fused_gemv.py)
# tune over the same.
GEMV_TILES = ((4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4),
              (16, 512, 8), (32, 256, 4), (32, 512, 8), (64, 128, 4), (64, 256, 8),
              (128, 128, 8))


@functools.cache
def _gemv_kernel(scaled: bool, f16: bool = False, tiled: bool = False):
    """Rows of x as programs. One autotuned kernel per weight kind (FP8 with scales, BF16
    without): the best tile for a (N, K) differs between 1- and 2-byte weights.

    ``f16`` ("rows16", FP8 weights): products and the per-lane running sums in FP16. The fp32
    GEMV spends ~2.5 instructions per FP8 weight (convert to f16, to f32, FMA) and streams only
    ~3 TB/s on the H200 (bench/gemv.py); e4m3 -> f16 is exact and packed two at a time, and f16
    multiply-adds are packed too. Each lane sums K / BLOCK_K products in FP16 (a few dozen at
    most), the lanes are summed in fp32; x is scaled by 1/64 first (exact) so that products of
    weights up to 448 overflow only past |x| ~ 9000. For drafts and the FP8 tail, whose FP8
    weights already round at ~2^-4; never for the exact model.

    ``tiled``: the kernel itself, for a launch with a tile given by hand (``tile_args``)."""
    import triton

    from .gemv_kernels import gemv_kernel

    if tiled:
        return triton, gemv_kernel, {"F16": f16}
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
               for n, k, w in GEMV_TILES]
    if _interpreted():
        return triton, gemv_kernel, {"BLOCK_N": 16, "BLOCK_K": 64, "F16": f16}
    return (triton, triton.autotune(configs=configs, key=["N", "K"])(gemv_kernel),
            {"F16": f16})


# Split-K's per-tile arrival counters (the fused GEMVs' split forms, ops/fused_gemv.py, and
# "dotsplit" here): cdiv(N, BLOCK_N) x M tiles at most.
MAX_TILES = 1 << 15


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """Split-K's per-tile arrival counters, zero between launches (each tile's last program
    sets its counter back): one buffer per device, allocated at first use (a warm-up, never
    inside a graph capture: the timed choices offer split-K only to keys they have timed).
    Shared, so split launches must not run concurrently on two streams: UNI MAX runs one engine
    thread, its forwards on one stream."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


# The tensor-core kernel's autotuned tiles (BLOCK_N, BLOCK_K, warps, stages).
DOT_TILES = ((16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 3), (64, 128, 4, 4),
             (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 2))


# "dotsplit": the tensor-core kernel with K in slices (BLOCK_N, BLOCK_K, warps, stages,
# slices), reduced in the same launch by each tile's last program. For the verifier's narrow,
# K-long linears at M = k + 1 (4B: the out- and down-projections, 2560 rows: 20-80 programs
# of "dot" on 132 SMs), where cuBLAS took the down-projection with a split-K GEMM and a reduce
# kernel after it, 16.4 us for 47 MB (69% of copy bandwidth, in a verify
# block). Offered where N <= DOTSPLIT_MAX_N and K >= 4 tiles of 256; the timed choice takes
# it only where faster. Never autotuned (the workspace's size is the tile's).
DOTSPLIT_TILES = ((32, 256, 4, 3, 4), (64, 256, 4, 3, 4), (32, 256, 4, 3, 8),
                  (64, 128, 4, 4, 8), (16, 256, 4, 3, 8))
DOTSPLIT_TILE = (32, 256, 4, 3, 4)  # where none is named
DOTSPLIT_MAX_N = 4096


def dotsplit_fits(m: int, n: int, k: int) -> bool:
    """Whether "dotsplit" is offered for this shape (see DOTSPLIT_TILES)."""
    return m > PROGRAM_ROWS and n <= DOTSPLIT_MAX_N and k >= 4 * 256  # (its counters fit)


@functools.cache
def _dot_kernel(scaled: bool, tiled: bool = False):
    """All rows of x (padded to 16 or 32) against a tile of W per program, on the tensor cores: W is
    read once for the whole block (the verifier's k tokens). ``tiled``: as _gemv_kernel."""
    import triton

    from .gemv_kernels import dot_kernel

    if tiled:  # (the interpreter's dot in fp32)
        return triton, dot_kernel, {"DOT_F32": _interpreted()}
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in DOT_TILES]
    if _interpreted():
        return triton, dot_kernel, {"BLOCK_N": 16, "BLOCK_K": 64, "DOT_F32": True}
    return (triton, triton.autotune(configs=configs, key=["N", "K"])(dot_kernel),
            {"DOT_F32": False})


# --- kernels named with a tile: "form@NxKxW" (x stages for "dot") ---------------------------
# The per-shape timed choice times each form at each of its tiles itself (in graphs, like a
# step) rather than leave the tile to Triton's autotuner, which times a lone call with L2
# flushed: the way the form choice timed before it missed by up to 44% (ops/timing.py).

DOT_TILE = (64, 256, 4, 3)  # "dot" where none is named (one of DOT_TILES)
TILES = {"rows": GEMV_TILES, "rows16": GEMV_TILES, "dot": DOT_TILES, "dotsplit": DOTSPLIT_TILES}


def tile_text(tile: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in tile)


def tiled_names(forms: tuple[str, ...], tiles: dict[str, tuple]) -> tuple[str, ...]:
    """Every form at every one of its tiles, as kernel names."""
    return tuple(f"{form}@{tile_text(tile)}" for form in forms for tile in tiles[form])


def parse_kernel(kernel: str, tiles: dict[str, tuple], what: str) -> tuple[str, tuple | None]:
    """"form" (its tile autotuned) or "form@tile" (that tile, one of the form's ``tiles``) ->
    (form, tile or None); ``what`` names the caller in errors."""
    form, _, named = kernel.partition("@")
    if form not in tiles:
        raise ValueError(f"{what}: kernel must be one of {', '.join(tiles)}, optionally with "
                         f"@tile, got {kernel!r}")
    if not named:
        return form, None
    parts = named.split("x")
    tile = tuple(int(v) for v in parts) if all(v.isdigit() for v in parts) else None
    if tile not in tiles[form]:
        raise ValueError(f"{what}: {kernel!r}: tile {named!r} is not one of {form}'s: "
                         f"{', '.join(tile_text(t) for t in tiles[form])}")
    return form, tile


def tile_args(tile: tuple[int, ...] | None) -> dict:
    """A tile's launch arguments: the autotuner's config, given by hand."""
    if tile is None:
        return {}
    n, k, warps, *stages = tile
    return {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps,
            **({"num_stages": stages[0]} if stages else {})}


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         kernel: str | None = None, swiglu: bool = False) -> torch.Tensor:
    """The Triton kernels (CUDA, or Triton's interpreter), M <= GEMV_ROWS. Same contract as
    ``gemv_ref``. ``kernel``: "rows" (the GEMV), "rows16" (the GEMV with FP16 products, FP8
    weights only) or "dot" (tensor cores), each autotuned, or "dotsplit" (tensor cores, K in
    slices: DOTSPLIT_TILES; at DOTSPLIT_TILE), or any with "@tile" (one of its TILES, as
    ``tiled_names`` writes it); by default rows for M <= PROGRAM_ROWS. ``swiglu`` ("dot"
    only): weight is [gate; up] (2N, K) and the result (M, N) silu(gate) * up, the activation
    in the kernel's epilogue (ops.gemv_swiglu, whose twin is swiglu_ref)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be (M, K) and (N, K)")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous (stride 1 along K)")
    m, k = x.shape
    if m > GEMV_ROWS:
        raise ValueError(f"gemv: at most {GEMV_ROWS} rows, got {m}")
    kernel, tile = parse_kernel(kernel or ("rows" if m <= PROGRAM_ROWS else "dot"), TILES,
                                "gemv")
    if kernel == "rows16" and scale is None:
        raise ValueError(f"gemv: {kernel} (FP16 products) is for FP8 weights only")
    if swiglu and kernel != "dot":
        raise ValueError(f"gemv: swiglu takes the dot kernel, got {kernel!r}")
    x = x.contiguous()
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    scaled = scale is not None
    if kernel in ("rows", "rows16"):
        triton, launch, fixed = _gemv_kernel(scaled, kernel == "rows16", tile is not None)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)  # noqa: E731
        launch[grid](x, weight, scale if scaled else x, y, n, k, x.stride(0),
                     weight.stride(0), y.stride(0), HAS_SCALE=scaled, **fixed,
                     **tile_args(tile))
    elif kernel == "dot":
        triton, launch, fixed = _dot_kernel(scaled, tile is not None)
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        launch[grid](x, weight, scale if scaled else x, y, y, y, m, n, k, x.stride(0),
                     weight.stride(0), y.stride(0), HAS_SCALE=scaled, BLOCK_M=dot_rows(m),
                     SWIGLU=swiglu, **fixed, **pdl_launch(x, weight), **tile_args(tile))
    else:  # dotsplit: the workspace and counters for its slices (see DOTSPLIT_TILES)
        *tile, split = tile or DOTSPLIT_TILE
        tiles = -(-n // tile[0])
        if tiles > MAX_TILES:
            raise ValueError(f"gemv: dotsplit takes at most {MAX_TILES} output tiles, got {tiles}")
        triton, launch, fixed = _dot_kernel(scaled, True)
        work = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        launch[(tiles, split)](x, weight, scale if scaled else x, y, work, _counters(x.device),
                               m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                               HAS_SCALE=scaled, BLOCK_M=dot_rows(m), SPLIT=split, **fixed,
                               **pdl_launch(x, weight), **tile_args(tuple(tile)))
    return y


# --- the op a compiled step calls, with its per-shape kernel choice -----------------------

CHOICES = choices.ChoiceTable("gemv")  # (M, N, K, weight dtype) -> "form@tile" or "cublas"


TIMING_ERRORS: list[str] = []  # graph timings that failed (then timed call by call): none expected
# what the choices' timing has cost this process (a share of the app's warm-up; the service
# bench prints it per mode): keys chosen, candidates timed, seconds
TIMING_SPENT = {"keys": 0, "candidates": 0, "seconds": 0.0}
# each timed key's candidates in us (inf: did not run), for the benches to show the margins
TIMED_US: dict[tuple, dict[str, float]] = {}


@functools.cache
def _unfit_errors() -> tuple[type[BaseException], ...]:
    """What Triton raises for a kernel config this GPU cannot run: the errors its autotuner
    skips a config for (none of them a RuntimeError)."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime import errors

    return tuple(e for e in (getattr(errors, "OutOfResources", None),
                             getattr(errors, "PTXASError", None), CompileTimeAssertionFailure)
                 if e is not None)


def _time_us(fn, copies: int, label: str = "") -> float:
    """Per-call time of ``fn(i)`` over weight copy i, as a step runs it (ops.timing.graph_us).
    A candidate that cannot run on this GPU at all (a tile past its shared memory: Triton's
    OutOfResources, which the autotuner used to skip) times as infinity. Should the graph
    timing itself fail, the call alone (do_bench, L2 flushed), and the error kept in
    TIMING_ERRORS with ``label`` (the shape and kernel): a kernel choice is a matter of speed
    and must not stop a reply."""
    try:
        return graph_us(fn, copies)  # (its warm-up calls, outside the capture, compile)
    except _unfit_errors():
        return math.inf
    except RuntimeError as err:
        TIMING_ERRORS.append(f"{label}: {err!r}"[:400])
        from triton.testing import do_bench

        return do_bench(lambda: fn(0), warmup=5, rep=20, return_mode="median") * 1e3


def dot_rows(m: int) -> int:
    """The tensor-core kernels' BLOCK_M for m rows: 16 up to 16 rows (the verifier's blocks of
    up to 15 drafts), else 32 (tl.dot's tiles are 16 rows at the least)."""
    return 16 if m <= 16 else 32


def candidates(m: int, scaled: bool, n: int = 0, k: int = 0) -> tuple[str, ...]:
    """The kernels worth timing for M rows of an (N, K) weight: the Triton kernel of that M,
    the GEMV with FP16 products for FP8 weights, the split-K tensor-core kernel where
    ``dotsplit_fits``, and cuBLAS for BF16 weights (for FP8 it would first dequantize them).
    Measured and left out (bench/gemv.py, H200, 4B shapes, M = 1): the tensor-core kernel,
    1.4x slower than the GEMV for FP8 weights with FP16 products and 1.06x for BF16."""
    if m > PROGRAM_ROWS:
        split = ("dotsplit",) if dotsplit_fits(m, n, k) else ()
        return ("dot",) + split + (() if scaled else ("cublas",))
    return ("rows", "rows16") if scaled else ("rows", "cublas")


def timed_choice(table: dict, key: tuple, names: tuple[str, ...], default: str, on_cuda: bool,
                 run, weights: tuple = (), keep_default: bool = False) -> str:
    """The fastest of ``names`` for ``key``, timed once and kept in ``table``: ``run(name,
    *weights)`` is one call with that kernel on those tensors (a weight and its scale), timed
    in a captured graph over copies of them (``_time_us``, ops.timing). A choice the shipped
    table or the disk cache remembers (ops.choices) is taken as is; one they do not, while
    choices are deferred (the app), takes ``default`` and is timed later, between replies.
    Off CUDA, in the interpreter, and for a key first met while a CUDA graph is being
    captured (it cannot be timed there): ``default``, not kept. Also the fused GEMVs' choice
    (ops/fused_gemv.py). ``keep_default``: a key first met on CUDA while a graph is being
    captured keeps ``default`` for good, for a choice that must stay one kernel for every later
    call (ops.short_recurrence)."""
    if key not in table:
        if not on_cuda or _interpreted():
            return default
        if torch.cuda.is_current_stream_capturing():
            if keep_default:
                table[key] = default
            return default
        if len(names) == 1:
            table[key] = names[0]
            return table[key]
        known = choices.remembered(table, key, names) \
            if isinstance(table, choices.ChoiceTable) else None
        if known is not None:
            table[key] = known
        elif choices.deferred() and isinstance(table, choices.ChoiceTable):
            table[key] = default
            choices.keep_for_later(table, key,
                                   lambda: _fastest(key, names, default, run, weights))
        else:
            table[key] = _fastest(key, names, default, run, weights)
    return table[key]


def _fastest(key: tuple, names: tuple[str, ...], default: str, run, weights: tuple) -> str:
    """``timed_choice``'s timing: each of ``names`` in a captured graph over copies of the
    weights; ``default`` where none ran."""
    start = time.perf_counter()
    copies = weight_copies(weights)
    times = {name: _time_us(lambda i, name=name: run(name, *copies[i]), len(copies),
                            f"{key} {name}")
             for name in names}
    best = min(times, key=times.get)
    TIMED_US[key] = times
    TIMING_SPENT["keys"] += 1
    TIMING_SPENT["candidates"] += len(names)
    TIMING_SPENT["seconds"] += time.perf_counter() - start
    return best if times[best] < math.inf else default  # (none ran: autotuned)


def choose(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    """The fastest of ``candidates`` for this shape, each Triton form at each of its tiles,
    timed once (``timed_choice``); the default Triton kernel, autotuned, where it cannot be
    timed."""
    key = (x.shape[0], *weight.shape, weight.dtype)
    if key in CHOICES:  # (every call after the first: no names to build)
        return CHOICES[key]
    forms = candidates(x.shape[0], scale is not None, *weight.shape)
    names = tiled_names(tuple(f for f in forms if f in TILES), TILES) + tuple(
        f for f in forms if f not in TILES)  # (cuBLAS picks its own tiles)
    return timed_choice(CHOICES, key, names,
                        "rows" if x.shape[0] <= PROGRAM_ROWS else "dot", x.is_cuda,
                        lambda name, w, s: _run(name, x, w, s), (weight, scale))


def _run(choice: str, x, weight, scale) -> torch.Tensor:
    if choice == "cublas":
        return torch.nn.functional.linear(x, weight)
    return gemv(x, weight, scale, kernel=choice)


@torch.library.custom_op("unimax::small_m_linear", mutates_args=())
def small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    # (Optional, not "| None": the op's schema is read from these annotations at import)
    """x (M <= GEMV_ROWS, K) @ weight^T (* scale): the Triton kernel or cuBLAS, per shape."""
    return _run(choose(x, weight, scale), x, weight, scale)


@small_m_linear.register_fake
def _(x, weight, scale=None):
    return x.new_empty(x.shape[0], weight.shape[0])
