"""The fused tensor-core form (unimax.ops.fused_dot) against the plain GEMM it would replace,
one linear at a time (GPU): a 4B model's four linears at M = 9 (a verify block of 8), BF16
weights, in CUDA-graph replays over weight copies that L2 cannot hold (ops.timing). Per linear
and tile: the plain GEMM on the prologue's output (ops.gemv), the fused form without a prologue
(the same loop: should match it), and with its prologue (and residual). What a prologue costs
the loop is the gap between the last two.

usage: python bench/fused_dot.py [--shape gdn-4b] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import bench_copies, linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.ops import gemv as gemv_mod  # noqa: E402
from unimax.ops.fused_dot import fused_dot  # noqa: E402
from unimax.ops.fused_gemv import prologue_ref  # noqa: E402
from unimax.ops.timing import graph_us  # noqa: E402

PROLOGUE = {"in_proj": ("rms", False), "out_proj": ("gated_silu", True),
            "gate_up": ("rms", False), "down": ("swiglu", True)}
TILES = ("dot@64x256x4x3", "dot@32x256x4x3", "dot@128x128x8x3", "dotsplit@32x256x4x3x4",
         "dotsplit@64x128x4x4x8")


def run_linear(name: str, n: int, k: int, m: int, head: int) -> list[dict]:
    prologue, residual = PROLOGUE[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = bench_copies(torch.randn(n, k, device="cuda", generator=gen,
                                       dtype=torch.bfloat16) * 0.02, None)
    copies = len(weights)
    x = 4 * torch.randn(m, 2 * k if prologue == "swiglu" else k, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
    gated = prologue.startswith("gated")
    z = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) if gated else None
    norm = ((1 + 0.1 * torch.randn(head if gated else k, device="cuda", generator=gen))
            .to(torch.bfloat16) if prologue != "swiglu" else None)
    r = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16) if residual \
        else None
    xin = prologue_ref(x, prologue, k, norm, z, 1e-6, 1.0).contiguous()
    rows = []
    for tile in TILES:
        if tile.startswith("dotsplit") and not gemv_mod.dotsplit_fits(m, n, k):
            continue
        if gated and int(tile.split("@")[1].split("x")[1]) < head:
            continue
        row = {"linear": name, "N": n, "K": k, "tile": tile}
        row["plain_us"] = graph_us(lambda i, t=tile: gemv_mod.gemv(xin, weights[i][0],
                                                                   kernel=t), copies)
        row["bare_us"] = graph_us(lambda i, t=tile: fused_dot(xin, weights[i][0], None, n, k,
                                                              "none", kernel=t), copies)
        row["fused_us"] = graph_us(lambda i, t=tile: fused_dot(
            x, weights[i][0], None, n, k, prologue, norm, z, r, 1e-6, 1.0, kernel=t), copies)
        rows.append(row)
        print(f"{name:9s} {tile:24s} plain {row['plain_us']:7.2f}  bare {row['bare_us']:7.2f}"
              f"  fused ({prologue}{'+res' if residual else ''}) {row['fused_us']:7.2f} us",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gdn-4b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = SHAPES[args.shape]
    rows = []
    for name, (n, k, _) in linear_shapes(cfg).items():
        if name in PROLOGUE:
            rows += run_linear(name, n, k, args.rows, cfg.head_v_dim)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
