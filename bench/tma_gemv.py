"""The fused GEMVs' TMA forms against the plain ones (GPU): each 4B draft linear (FP8, M = 1,
with the draft's prologue and residual) at the plain form and tile the H200's timed choice
took (sixteenth session) and at every TMA form and tile (unimax.ops.fused_gemv.TMA_FORMS),
graph-timed over weight copies as the choice times them; errors printed per candidate, not
hidden (the choice times a failing candidate as infinitely slow).

usage: python bench/tma_gemv.py [--shape gdn-4b] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from gemv import FOLDS, bench_copies, linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops import fused_gemv as fused  # noqa: E402
from unimax.ops.timing import graph_us  # noqa: E402

# the FP8 kernels the H200's timed choice took for gdn-4b (sixteenth session)
CHOSEN = {"in_proj": "rows16@16x256x4", "out_proj": "rows@4x1024x4",
          "gate_up": "rows16@32x256x4", "down": "split16@16x512x8"}


def linear_rows(cfg, name: str, n: int, k: int, bandwidth: float) -> list[dict]:
    prologue, residual, width = FOLDS[name]
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    weights = bench_copies(q, scale)
    x = torch.randn(1, width * k, device="cuda", dtype=torch.bfloat16)
    gated = prologue.startswith("gated")
    head = cfg.head_v_dim if gated else 1
    z = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if gated else None
    norm = (torch.ones(head if gated else k, device="cuda", dtype=torch.bfloat16)
            if prologue != "swiglu" else None)
    res = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if residual else None
    kernels = [CHOSEN[name]] + [name for name in fused.candidates(n, k, 1, True, head, tma=True)
                                if name.startswith("tma")]  # (the TMA forms offered here)
    rows = []
    for kernel in kernels:
        row = {"linear": name, "N": n, "K": k, "kernel": kernel}
        try:
            us = graph_us(lambda i, kernel=kernel: fused.fused_gemv(
                x, *weights[i], n, k, prologue, norm, z, res, kernel=kernel), len(weights))
            row.update(us=us, of_copy=q.numel() / (us * 1e-6) / bandwidth)
        except Exception as err:  # noqa: BLE001 (a bench row: the error is the result)
            row["error"] = repr(err)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gdn-4b")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    cfg = SHAPES[args.shape]
    rows = []
    for name, (n, k, _) in linear_shapes(cfg).items():
        if name in FOLDS:
            rows += linear_rows(cfg, name, n, k, bandwidth)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.shape} FP8 fused GEMVs, M = 1")
    print(f"{'linear':9} {'kernel':22} {'us':>7} {'of copy':>8}")
    for row in rows:
        text = (f"{row['us']:7.2f} {row['of_copy']:8.2f}" if "us" in row
                else row["error"][:60])
        print(f"{row['linear']:9} {row['kernel']:22} {text}")


if __name__ == "__main__":
    main()
