"""How the per-shape kernel choices (ops.gemv.timed_choice) time their candidates on the GPU: as a
decode step runs them, back to back in a captured CUDA graph, over enough copies of the weight
that the L2 cache cannot serve it.

Why not one call at a time (Triton's do_bench, the choice's first timer): a call timed alone
pays its launch and its ramp in full, and a 5-15 us GEMV is mostly that; in a step, kernels
follow one another in a graph. On the H200 (2026-12-01, bench/gemv.py --fused) the choice
made that way disagreed with the graph-timed fastest form on 5 of 8 draft linears, by up to 44%
(0.8B out_proj: rows 6.2 us taken, rows16 4.3), and changed from run to run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

L2_SAFE_BYTES = 128 << 20  # over twice the L2 of the GPUs we run on (H200 60 MB, L4 48 MB)
MIN_CALLS = 4  # calls per captured graph: its own launch is spread over them


def interpreted() -> bool:
    """Whether Triton runs in its CPU interpreter (the tests): no timing, no PTX."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def weight_copies(tensors: Sequence[torch.Tensor | None],
                  total_bytes: int = L2_SAFE_BYTES) -> list[tuple]:
    """``tensors`` (a weight and its scale, say) and as many clones as make ``total_bytes``
    together; a weight that alone is that large is used as is. None entries stay None."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    copies = max(1, -(-total_bytes // nbytes)) if nbytes else 1
    return [tuple(tensors)] + [tuple(None if t is None else t.clone() for t in tensors)
                               for _ in range(copies - 1)]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the with-block (as it was, after): for a CUDA
    graph capture. A collection that runs mid-capture frees whatever garbage is in cycles, and
    a CUDA graph among it (an engine dropped earlier) is destroyed then, a call not permitted
    while this thread captures: the capture fails, "operation failed due to a previous error
    during capture", after warnings "operation not permitted when stream is capturing (function
    reset)". That is what failed a choice's timing in the H200 suite (2026-12-01), eight graphs
    reset at once, and only with the earlier tests' engines in the same process.
    torch.cuda.graph() collects on entry, but a collection can still start inside.
    The collector is one per process: nested or concurrent pauses (two threads) end together,
    the last one out restoring what the first one in found."""
    global _pauses, _gc_was_on
    with _pause_lock:
        if _pauses == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _gc_was_on:
                gc.enable()


_pause_lock = threading.Lock()
_pauses = 0  # gc_paused blocks running now, in any thread
_gc_was_on = True  # whether the collector was on when the first of them began


def graph_us(fn: Callable[[int], object], copies: int, repeats: int = 5) -> float:
    """Per-call time (us) of ``fn(i)``, i cycling over ``copies`` weight copies, from the median
    replay of a captured graph of max(copies, MIN_CALLS) calls. ``fn`` is called (warmed up:
    compiled, autotuned) outside the capture first."""
    calls = max(copies, MIN_CALLS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for i in range(min(copies, 2)):  # (compiles; copies are alike: same shapes, aligned)
            fn(i)
        stream.synchronize()
        # capture_begin, not torch.cuda.graph(): that one collects garbage and empties the
        # allocator's cache on entry, ~0.1 s each in a big process, and a warm-up times
        # hundreds of candidates. thread_local, as the engine's own captures: another
        # thread's CUDA call (none expected) must not void this capture.
        with gc_paused():
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for i in range(calls):
                    fn(i % copies)
            except BaseException:
                # end the capture, but raise fn's own error: capture_end's ("operation failed
                # due to a previous error during capture") names no cause
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    us = median_replay_ms(graph, repeats) * 1e3 / calls
    del graph
    return us


def median_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 5,
                     before: Callable[[], None] = lambda: None) -> float:
    """The median time of a graph's replay in ms (CUDA events; after one untimed replay).
    ``before`` runs ahead of each replay, untimed (capture: back to position 0)."""
    before()
    graph.replay()  # the first replay uploads the graph
    times = []
    for _ in range(repeats):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]
