"""Can L2 prefetching hide the draft GEMVs' fixed cost? (GPU; an experiment: no. On the H200,
fifteenth session, every prefetching variant was slower, 0.68-0.94x the chain without it, so
nothing in unimax prefetches: bench/RESULTS.md.)

Under Nsight Compute (bench/ncu_gemv.py, fifteenth session) the draft's FP8 GEMVs at 4B run
1.3-3.0 TB/s where the LM head's long GEMV runs 4.2: each short GEMV pays a ramp (its first
loads' latency) and a tail, and between them the mixer (conv, recurrence: ~5 us per layer)
reads almost nothing from memory. None of the weights depend on the step's data, so the next
linear's weights can be asked into the 60 MB L2 before it runs, while this one (or the mixer)
runs: DRAM then stays busy through the ramps and the mixer.

A chain of 8 gdn-4b layers' FP8 linears (in_proj, a ~5 us spin standing in for the mixer,
out_proj, gate_up, down: 0.9 GB, so nothing stays in L2 from one replay to the next), each
through the draft's fused GEMV at the tile the H200's timed choice took, captured in a CUDA
graph, with and without a prefetch kernel before each GEMV for the next linear's weights:
``prefetch.global.L2::evict_last`` per 128-byte line ("line"), or Hopper's bulk
``cp.async.bulk.prefetch.L2`` per 16 KB ("bulk", compute capability 9+), of the whole next
weight or its first MB only; or before the mixer only. Prints us per layer and the rate over
its 113 MB, against the chain without prefetching, and checks the outputs do not change.

usage: python bench/l2_prefetch.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from gemv import linear_shapes  # noqa: E402
from ncu_gemv import LINEARS  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops.fused_gemv import fused_gemv  # noqa: E402

LAYERS = 8
MIXER_CYCLES = 10_000  # torch.cuda._sleep: ~5 us at the H200's ~1.98 GHz (conv + recurrence)


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                       BULK: tl.constexpr):
    """Ask bytes [0, nbytes) of ptr into L2 and return at once: each lane one CHUNK-byte piece
    (BULK: one bulk prefetch of it; else CHUNK is a 128-byte line)."""
    offs = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    size = tl.where(offs < nbytes, tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    addr = ptr + offs
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(weight: torch.Tensor, bulk: bool, limit: int | None = None) -> None:
    flat = weight.view(torch.uint8).reshape(-1)
    nbytes = flat.numel() if limit is None else min(limit, flat.numel())
    chunk, chunks = (16384, 64) if bulk else (128, 1024)
    grid = (triton.cdiv(nbytes, chunk * chunks),)
    l2_prefetch_kernel[grid](flat, nbytes, CHUNK=chunk, CHUNKS=chunks, BULK=bulk, num_warps=2)


def make_layers(cfg) -> list[list[dict]]:
    sizes = linear_shapes(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        linears = []
        for name, (_, _, kernel, _) in LINEARS.items():
            n, k, _ = sizes[name]
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            q, s = quantize_rows(w)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            linears.append(dict(name=name, w=q, s=s, x=x, n=n, k=k,
                                kernel=kernel))
        layers.append(linears)
    return layers


def chain(layers, variant: str) -> list[torch.Tensor]:
    """One pass over the layers as ``variant`` orders it; returns the GEMVs' outputs."""
    flat = [lin for layer in layers for lin in layer]
    bulk = variant.startswith("bulk")
    outs = []
    for i, lin in enumerate(flat):
        after = flat[(i + 1) % len(flat)]["w"]
        if lin["name"] == "out_proj":  # the mixer stand-in before it
            if variant.endswith("mixer"):
                l2_prefetch(lin["w"], bulk)
            torch.cuda._sleep(MIXER_CYCLES)
        if variant.endswith("next"):
            l2_prefetch(after, bulk)
        elif variant.endswith("next4MB"):
            l2_prefetch(after, bulk, 4 << 20)
        outs.append(fused_gemv(lin["x"], lin["w"], lin["s"], lin["n"], lin["k"], "none",
                               kernel=lin["kernel"]))
    return outs


def time_variant(layers, variant: str, replays: int = 20) -> tuple[float, list]:
    outs = chain(layers, variant)  # (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(layers, variant)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS, [o.clone() for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = SHAPES["gdn-4b"]
    layers = make_layers(cfg)
    layer_bytes = sum(lin["w"].numel() for lin in layers[0])
    bandwidth = copy_bandwidth()
    variants = ["none", "line-next", "line-next4MB", "line-mixer"]
    if torch.cuda.get_device_capability()[0] >= 9:
        variants += ["bulk-next", "bulk-next4MB", "bulk-mixer"]
    rows, reference = [], None
    for variant in variants + ["none"]:  # (none again: the run's drift)
        us, outs = time_variant(layers, variant)
        if reference is None:
            reference = outs
        same = all(torch.equal(a, b) for a, b in zip(reference, outs, strict=True))
        rows.append({"variant": variant, "us_per_layer": us,
                     "tb_s": layer_bytes / us / 1e6, "of_copy": layer_bytes / us / 1e6 /
                     (bandwidth / 1e12), "same_outputs": same})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    base = rows[0]["us_per_layer"]
    print(f"gdn-4b FP8 layer linears, {layer_bytes / 1e6:.0f} MB per layer, copy "
          f"{bandwidth / 1e9:.0f} GB/s, mixer spin {MIXER_CYCLES} cycles")
    print(f"{'variant':16} {'us/layer':>9} {'TB/s':>6} {'of copy':>7} {'x none':>7} same")
    for r in rows:
        print(f"{r['variant']:16} {r['us_per_layer']:9.2f} {r['tb_s']:6.2f} {r['of_copy']:7.2f} "
              f"{base / r['us_per_layer']:7.3f} {r['same_outputs']}")


if __name__ == "__main__":
    main()
