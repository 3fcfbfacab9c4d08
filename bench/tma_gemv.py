"""The fused GEMVs' TMA forms against the plain ones (GPU): each 4B draft linear (FP8, M = 1,
with the draft's prologue and residual) at the plain form and tile the H200's timed choice
took (sixteenth session) and at every TMA form and nameable tile (ops.fused_gemv.TMA_TILES),
graph-timed over weight copies as the choice times them; errors printed per candidate, not
hidden (the choice times a failing candidate as infinitely slow). On the K-long narrow
linears (out_proj, down: where split-K is offered) also a sweep: the split forms at SPLIT_K
2 and 8 (4 is the default) and the TMA forms at 3 and 5 stages.

usage: python bench/tma_gemv.py [--shape gdn-4b] [--json FILE] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from gemv import FOLDS, fold_inputs, linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.ops import fused_gemv as fused  # noqa: E402
from unimax.ops.gemv import tiled_names  # noqa: E402
from unimax.ops.timing import graph_us  # noqa: E402

# the FP8 kernels the H200's timed choice took for gdn-4b (sixteenth session)
CHOSEN = {"in_proj": "rows16@16x256x4", "out_proj": "rows@4x1024x4",
          "gate_up": "rows16@32x256x4", "down": "split16@16x512x8"}


def linear_rows(cfg, name: str, n: int, k: int, bandwidth: float, sweep: bool) -> list[dict]:
    """The linear at its chosen plain kernel and every TMA form offered; with ``sweep`` and
    where split-K is offered, the split forms at SPLIT_K 2, 4 and 8 and the TMA forms at 3 and
    5 stages too (module settings changed for the bench only, put back after)."""
    prologue, head, weights, q, x, z, norm, res = fold_inputs(cfg, name, n, k)
    rows = []

    def timed(kernel: str, **setting) -> None:
        row = {"linear": name, "N": n, "K": k, "kernel": kernel, **setting}
        try:
            us = graph_us(lambda i: fused.fused_gemv(
                x, *weights[i], n, k, prologue, norm, z, res, kernel=kernel), len(weights))
            row.update(us=us, of_copy=q.numel() / (us * 1e-6) / bandwidth)
        except Exception as err:  # noqa: BLE001 (a bench row: the error is the result)
            row["error"] = repr(err)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)

    timed(CHOSEN[name])
    split = fused.split_fits(n, k, 1, True)
    forms = fused.TMA_FORMS if split else ("tma", "tma16")
    for kernel in tiled_names(forms, fused._tiles_by_form(head)):  # (all, not just the offered)
        timed(kernel)
    if not sweep or not fused.split_fits(n, k, 1, True):
        return rows
    saved = fused.SPLIT_K, fused.TMA_TILES
    try:
        for split in (2, 8):
            fused.SPLIT_K = split
            for kernel in ("split16@16x512x8", "tmasplit16@16x256x4x4",
                           "tmasplit16@32x256x4x4"):
                timed(kernel, split=split)
        fused.SPLIT_K = saved[0]
        for stages in (3, 5):
            fused.TMA_TILES = ((32, 256, 4, stages),)
            fused._tiles_by_form.cache_clear()
            for form in ("tma16", "tmasplit16"):
                timed(f"{form}@32x256x4x{stages}", stages=stages)
    finally:
        fused.SPLIT_K, fused.TMA_TILES = saved
        fused._tiles_by_form.cache_clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gdn-4b")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-sweep", action="store_true",
                        help="without the split-K counts and TMA stages swept (K-long linears)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    cfg = SHAPES[args.shape]
    rows = []
    for name, (n, k, _) in linear_shapes(cfg).items():
        if name in FOLDS:
            rows += linear_rows(cfg, name, n, k, bandwidth, not args.no_sweep)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.shape} FP8 fused GEMVs, M = 1")
    print(f"{'linear':9} {'kernel':24} {'setting':10} {'us':>7} {'of copy':>8}")
    for row in rows:
        text = (f"{row['us']:7.2f} {row['of_copy']:8.2f}" if "us" in row
                else row["error"][:60])
        setting = (f"split {row['split']}" if "split" in row else
                   f"stages {row['stages']}" if "stages" in row else "")
        print(f"{row['linear']:9} {row['kernel']:24} {setting:10} {text}")


if __name__ == "__main__":
    main()
