"""Where a draft GEMV's time goes past a plain read of its weight (GPU).

bench/small_reads.py (eighteenth session) found that a kernel which only reads W's bytes, a
program per 8 KB tile, takes 2.5 us + bytes / 4.15 TB/s on the H200; each of the 4B draft's
four FP8 fused GEMVs takes ~2 us more than that at its size, whatever the size. This bench
takes the excess apart, per linear at the kernel and tile the timed choice took in the draft
step (DRAFT_KERNELS), each graph-timed over weight copies as the choice times them:

- ``draft``: the draft's call (its prologue, its residual);
- ``no-res``: without the residual (the epilogue's extra load and add);
- ``bare``: no prologue, no residual (x as the linear's input: a plain FP8 GEMV);
- ``bare-rows``: the bare GEMV at the rows form and the draft's tile where the draft's is a
  TMA form (rows16 for the FP16 ones), to tell the form from the prologue;
- ``read``: bench/small_reads.py's ``one`` kernel over the same bytes (no x, no output);
- ``launch``: that kernel over one 8 KB tile (a launch and nothing else, in a graph);
- ``rms pre-pass`` / ``rms in loop`` (the RMS linears): the draft's call at the form with
  fp32 products (rows16 -> rows), its norm's pre-pass first or its squares summed in the K
  loop (ops.fused_gemv.RMS_IN_LOOP).

If ``bare`` sits near ``read``, the excess is the prologue and epilogue (computing the norm
once, before, or overlapping it with W's first tiles is the next step); if ``bare`` keeps the
excess, it is the GEMV's own structure (its products and per-tile reduction, or its store).
``--bf16``: the BF16 step's GEMVs instead (BF16 weights at that step's chosen kernels,
BF16_KERNELS): whether their excess over a read is the FP8 ones' (shared fixed cost) or
smaller (the FP8 forms' own: conversions, products).

usage: python bench/gemv_parts.py [--shape gdn-4b] [--bf16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from gemv import FOLDS, bench_copies, fold_inputs, linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402
from small_reads import COLS, ROWS, launcher  # noqa: E402

from unimax.ops import fused_gemv as fused  # noqa: E402
from unimax.ops.timing import graph_us, weight_copies  # noqa: E402

# the FP8 kernels the H200's timed choice took in the 4B draft step (eighteenth session,
# bench/RESULTS.md; in_proj's there with the convolution folded in)
DRAFT_KERNELS = {"in_proj": "tma@32x256x4x4", "out_proj": "rows@4x1024x4",
                 "gate_up": "rows16@32x256x4", "down": "tmasplit16@32x256x4x4"}
# the BF16 weights' (the BF16 step's; the same run)
BF16_KERNELS = {"in_proj": "rows@16x256x4", "out_proj": "rows@16x512x8",
                "gate_up": "rows@8x512x4", "down": "rows@4x1024x4"}


def rows_twin(kernel: str) -> str | None:
    """A TMA form's plain twin at the rows form and its tile's first three numbers."""
    form, tile = kernel.split("@")
    if not form.startswith("tma"):
        return None
    plain = form.replace("tma", "rows" if "split" not in form else "")
    return f"{plain}@{'x'.join(tile.split('x')[:3])}"


def linear_parts(cfg, name: str, n: int, k: int, bandwidth: float,
                 bf16: bool = False) -> list[dict]:
    prologue, _, weights, q, x, z, norm, res = fold_inputs(cfg, name, n, k)
    if bf16:
        weights = bench_copies(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 50, None)
        q = weights[0][0]
    bare_x = x[:, :k].contiguous()
    kernel = (BF16_KERNELS if bf16 else DRAFT_KERNELS)[name]
    rows = []

    def timed(variant: str, fn, copies: int) -> None:
        row = {"linear": name, "N": n, "K": k, "variant": variant, "MB": q.nbytes / 1e6}
        try:
            us = graph_us(fn, copies)
            row.update(us=us, of_copy=q.nbytes / (us * 1e-6) / bandwidth)
        except Exception as err:  # noqa: BLE001 (a bench row: the error is the result)
            row["error"] = repr(err)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)

    def gemv(kern, pro, xs, zs, ns, rs):
        return lambda i: fused.fused_gemv(xs, *weights[i], n, k, pro, ns, zs, rs, kernel=kern)

    timed(f"draft {kernel}", gemv(kernel, prologue, x, z, norm, res), len(weights))
    timed("no-res", gemv(kernel, prologue, x, z, norm, None), len(weights))
    timed("bare", gemv(kernel, "none", bare_x, None, None, None), len(weights))
    if prologue == "rms":
        form, tile = kernel.split("@")
        fp32 = f"{form.removesuffix('16')}@{tile}"
        saved = fused.RMS_IN_LOOP
        try:
            for loop in (False, True):
                fused.RMS_IN_LOOP = loop
                timed(f"rms {'in loop' if loop else 'pre-pass'} {fp32}",
                      gemv(fp32, prologue, x, z, norm, res), len(weights))
        finally:
            fused.RMS_IN_LOOP = saved
    twin = rows_twin(kernel)
    if twin:
        timed(f"bare-rows {twin}", gemv(twin, "none", bare_x, None, None, None), len(weights))
    words = [w.view(torch.int32).view(-1, COLS) for w, _ in weights]
    reads = [launcher(w, dict(chain=1, tma=False, stages=1)) for w in words]
    timed("read", lambda i: reads[i](), len(reads))
    return rows


def launch_row(bandwidth: float) -> dict:
    tile = torch.zeros(ROWS, COLS, dtype=torch.int32, device="cuda")
    calls = [launcher(w, dict(chain=1, tma=False, stages=1)) for (w,) in
             weight_copies([tile], 64 * tile.nbytes)]
    us = graph_us(lambda i: calls[i](), len(calls))
    row = {"linear": "-", "variant": "launch", "MB": tile.nbytes / 1e6, "us": us,
           "of_copy": tile.nbytes / (us * 1e-6) / bandwidth}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gdn-4b")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    cfg = SHAPES[args.shape]
    rows = [launch_row(bandwidth)]
    for name, (n, k, _) in linear_shapes(cfg).items():
        if name in FOLDS:
            rows += linear_parts(cfg, name, n, k, bandwidth, args.bf16)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    kind = "BF16 step" if args.bf16 else "FP8 draft"
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.shape} {kind} GEMVs, M = 1")
    print(f"{'linear':9} {'variant':34} {'MB':>6} {'us':>7} {'of copy':>8}")
    for row in rows:
        text = (f"{row['us']:7.2f} {row['of_copy']:8.2f}" if "us" in row
                else row["error"][:60])
        print(f"{row['linear']:9} {row['variant']:34} {row['MB']:6.1f} {text}")


if __name__ == "__main__":
    main()
