"""The draft's GEMVs on a card with less bandwidth, emulated (GPU): the 4B layer's four linears at
M = 1, BF16 against FP8, with the GPU cut to N SMs (a CUDA green context) or its DRAM shared
with a copying hog.

The full-FP8 draft step costs 0.66 of a BF16 step on an H200 and 0.63 on an H100, where its
bytes say ~0.5: each GEMV pays a few us that its bytes do not need, and the faster the memory,
the larger that share (docs/design.md). The goals are set on an H200; the product is demoed on
an L4 (300 GB/s, ~5 GB/s an SM). No L4 is lent, so this bench asks whether the FP8/BF16 ratio of
the same kernels falls toward the bytes' 0.5 when they get less bandwidth, two ways:

- ``--sms N``: the kernels on N SMs of the card (green context): less bandwidth, but each SM's
  issue rate and latency stay the H100's, so per SM the kernels run at ~27 GB/s, 5x an L4 SM;
- ``--hog P``: the whole card, beside P programs copying on another stream (``Hog``): less
  bandwidth with every SM, but DRAM's queues (latency) longer too.

Neither is an L4 (its latency is not longer, its SMs are not busier); the sixty-fifth session
found the ratio rising both ways (bench/RESULTS.md).

Per row: a 1 GiB copy's bandwidth (before and after the GEMVs, the hog running through both),
then LAYERS copies of the four linears (in_proj, out_proj, gate_up, down at the Qwen3.5-4B /
gdn-4b sizes; 226 MB a layer in BF16), each through ``unimax::small_m_linear``, captured in one
CUDA graph per dtype and timed by replays. The per-shape timed choices are made once, by the
first row (on the whole card with the default ``--sms 0 ...``; they are printed): the same
kernels in every row. Plain GEMVs, not the draft's fused forms: the same kernels' fixed cost,
without the prologues.

usage: python bench/green_sms.py [--sms 0 66 33 16 8] [--hog 16 33 66 100] [--layers 8]
       [--json FILE]   (--sms 0: no green context, the whole card)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from shapes import GDN_4B

from unimax.fp8 import quantize_rows
from unimax.ops import gemv


def layer_linears(c) -> dict[str, tuple[int, int]]:
    """(out, in) of a GDN decode layer's linears: in_proj (q, k, v, z, b, a), out_proj, gate_up
    (gate; up), down."""
    key, value = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
    return {"in_proj": (2 * key + 2 * value + 2 * c.num_v_heads, c.hidden_size),
            "out_proj": (c.hidden_size, value),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


LINEARS = layer_linears(GDN_4B)  # 12352 x 2560, 2560 x 4096, 18432 x 2560, 2560 x 9216


def replay_seconds(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, repeats: int) -> float:
    """Median wall seconds of one replay, over bursts of 10 replays queued back to back, timed
    by the host around a sync of this stream alone (decode.median_device_seconds synchronizes
    the whole device, which would wait for the hog)."""
    times = []
    for _ in range(repeats):
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            graph.replay()
        stream.synchronize()
        times.append((time.perf_counter() - start) / 10)
    return sorted(times)[len(times) // 2]


def copy_graph(stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, int, tuple]:
    """A 1 GiB copy captured (graphs are captured before any hog runs: a capture synchronizes
    the whole device, which would wait for the hog to finish) and the bytes it moves."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    graph = torch.cuda.CUDAGraph()
    dst.copy_(src)
    with torch.cuda.graph(graph, stream=stream):
        dst.copy_(src)
    return graph, 2 * src.numel() * 4, (src, dst)  # (the buffers: kept alive with the graph)


def chain_graph(layers: list[dict], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """The captured chain of every layer's four linears."""
    def step():
        for layer in layers:
            for x, weight, scale in layer.values():
                torch.ops.unimax.small_m_linear(x, weight, scale)
    step()  # (the first time: the timed choices and Triton's compiles)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph


def build_layers(count: int, fp8: bool) -> list[dict]:
    layers = []
    for _ in range(count):
        layer = {}
        for name, (n, k) in LINEARS.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            layer[name] = (x, *quantize_rows(w)) if fp8 else (x, w, None)
        layers.append(layer)
    return layers


@triton.jit
def hog_kernel(src, dst, n, BLOCK: tl.constexpr):
    """Copies src to dst, grid-strided over as many programs as the grid has."""
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)


class Hog:
    """Copies that keep DRAM busy beside the measurement, from ``programs`` programs on a stream
    of its own: less bandwidth left to the GEMVs, the SMs' issue rate mostly still theirs (what
    an L4's ~5 GB/s an SM is like; fewer SMs alone cut the issue rate too). Only replays run
    while it does: a graph capture synchronizes the whole device and would wait for it."""

    def __init__(self, programs: int):
        self.programs = programs
        self.stream = torch.cuda.Stream()
        self.src = torch.randn(1 << 26, device="cuda")  # 256 MiB
        self.dst = torch.empty_like(self.src)
        self.graph = torch.cuda.CUDAGraph()
        launch = lambda: hog_kernel[(programs,)](self.src, self.dst, self.src.numel(),  # noqa: E731
                                                  BLOCK=4096, num_warps=8)
        with torch.cuda.stream(self.stream):
            launch()
            self.stream.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream):
                for _ in range(20):
                    launch()
        self.stream.synchronize()

    def start(self, replays: int) -> None:
        with torch.cuda.stream(self.stream):  # (a graph replays on the current stream)
            for _ in range(replays):  # queued, not waited for: they run beside the measurement
                self.graph.replay()

    def stop(self) -> None:
        self.stream.synchronize()


def measure(sms: int, count: int, hog: Hog | None = None, hog_replays: int = 0) -> dict:
    context = None
    if sms:
        context = torch.cuda.green_contexts.GreenContext.create(num_sms=sms)
        context.set_context()
        stream = context.Stream()
    else:
        stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            row = {"sms": sms or torch.cuda.get_device_properties(0).multi_processor_count,
                   "hog_programs": hog.programs if hog else 0}
            built = {label: build_layers(count, fp8)
                     for label, fp8 in (("bf16", False), ("fp8", True))}
            graphs = {label: chain_graph(layers, stream) for label, layers in built.items()}
            copy, moved, _buffers = copy_graph(stream)
            if hog:
                hog.start(hog_replays)
            row["copy_gbs"] = moved / replay_seconds(copy, stream, 10) / 1e9
            for label, graph in graphs.items():
                row[f"{label}_us"] = replay_seconds(graph, stream, 30) / count * 1e6
            row["copy_gbs_after"] = moved / replay_seconds(copy, stream, 10) / 1e9
            if hog:
                hog.stop()
            del built, graphs, copy
            torch.cuda.empty_cache()
    finally:
        if context is not None:
            stream.synchronize()
            context.pop_context()
    weight_bytes = sum(n * k for n, k in LINEARS.values())
    for label, per in (("bf16", 2), ("fp8", 1)):
        floor_us = weight_bytes * per / (row["copy_gbs"] * 1e9) * 1e6
        row[f"{label}_floor_pct"] = 100 * floor_us / row[f"{label}_us"]
    row["ratio"] = row["fp8_us"] / row["bf16_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sms", nargs="+", type=int, default=[0, 66, 33, 16, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hog", nargs="+", type=int, default=[],
                        help="after the --sms rows, the measured side beside a hog of each of "
                        "these many copying programs (Hog)")
    parser.add_argument("--hog-replays", type=int, default=300)
    parser.add_argument("--hog-engine-sms", type=int, default=0,
                        help="the SMs of the measured side in the --hog rows (0: the whole "
                        "card, in the primary context)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print("green contexts supported:", torch.cuda.green_contexts.SUPPORTED, flush=True)
    rows = []
    runs = [(sms, 0) for sms in args.sms] + [(args.hog_engine_sms, hog) for hog in args.hog]
    for sms, programs in runs:
        try:
            hog = Hog(programs) if programs else None
            rows.append(measure(sms, args.layers, hog, args.hog_replays))
            print(json.dumps(rows[-1]), flush=True)
        except Exception as error:  # (a driver without green contexts: say so, go on)
            print(f"sms {sms} hog {programs}: {type(error).__name__}: {error}", flush=True)
    print("choices:", {f"{k[1]}x{k[2]} {k[3]}": v for k, v in gemv.CHOICES.items()})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| SMs | hog programs | copy GB/s (after) | BF16 us/layer (floor %) "
          "| FP8 us/layer (floor %) | FP8 / BF16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sms']} | {r['hog_programs']} | {r['copy_gbs']:.0f} "
              f"({r['copy_gbs_after']:.0f}) | {r['bf16_us']:.1f} "
              f"({r['bf16_floor_pct']:.0f}%) | {r['fp8_us']:.1f} ({r['fp8_floor_pct']:.0f}%) | "
              f"{r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
