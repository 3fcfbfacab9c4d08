"""The draft's MLP as one launch (unimax.ops.fused_mlp) against the two fused GEMVs it replaces
(GPU): per shape, FP8 weights at M = 1, graph-timed over weight copies (400 MB, so each call
reads from memory), as the op's timed choice times them.

Rows: "apart" (gate_up with the RMS prologue, then down with the SwiGLU prologue and the
residual, each at the kernel its own timed choice takes), every form and tile of the fused
kernel (ops.fused_mlp.TILES), and what the op's timed choice took; each under plain launches
and under PDL "fp8" signalled at the start and at the end (the draft's settings: in the engine
each graph times its own). Each fused row's output against apart's: the largest difference in
BF16 ulps of the output (the sums land in another order) and whether two runs agree.

usage: python bench/fused_mlp.py [--shapes qwen3.5-4b qwen3.5-0.8b] [--kernels NAME ...]
                                [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from gemv import bench_copies  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops import fused_gemv as fused  # noqa: E402
from unimax.ops import fused_mlp as mlp  # noqa: E402
from unimax.ops.timing import graph_us  # noqa: E402

PDL_SETTINGS = ((False, "start"), ("fp8", "start"), ("fp8", "end"))


def inputs(hidden: int, inter: int) -> tuple:
    torch.manual_seed(0)
    gu, sgu = quantize_rows(torch.randn(2 * inter, hidden, device="cuda",
                                        dtype=torch.bfloat16) * 0.02)
    d, sd = quantize_rows(torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02)
    pairs = [(a[0], a[1], b[0], b[1]) for a, b in zip(bench_copies(gu, sgu), bench_copies(d, sd),
                                                       strict=False)]
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    norm = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    return x, norm, pairs


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of b's BF16 spacing."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-30)
    return float(((a.float() - b.float()).abs() / spacing).max())


def shape_rows(name: str, bandwidth: float, only: list[str] | None = None) -> list[dict]:
    cfg = SHAPES[name]
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    x, norm, pairs = inputs(hidden, inter)
    mb = sum(t.nbytes for t in pairs[0] if t is not None) / 1e6
    args = lambda i: (x, norm, *pairs[i], inter, 1e-6, 1.0)  # noqa: E731
    base = mlp.apart(*args(0))  # (the GEMVs' own timed choices made here)
    names = ("apart", *(only or mlp.candidates(x, pairs[0][0], True)[1:]))
    rows = []
    for setting, trigger in PDL_SETTINGS:
        with fused.auto_pdl(setting, trigger):
            saved = fused.PDL
            fused.PDL = "auto"
            try:
                for kernel in names:
                    row = {"shape": name, "pdl": fused.pdl_label(setting, trigger),
                           "kernel": kernel, "MB": mb}
                    try:
                        if kernel != "apart":
                            one, two = (mlp.run(kernel, *args(0)) for _ in range(2))
                            row.update(ulps=ulps(one, base), repeat=bool(torch.equal(one, two)))
                        us = graph_us(lambda i, k=kernel: mlp.run(k, *args(i)), len(pairs))
                        row.update(us=us, of_copy=mb * 1e6 / (us * 1e-6) / bandwidth)
                    except Exception as err:  # noqa: BLE001 (a bench row: the error is it)
                        row["error"] = repr(err)[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                fused.PDL = saved
    # what the atomics cost: the fastest fused forms (plain launches) with plain stores instead
    plain = sorted((r for r in rows if r["pdl"] == "False" and "us" in r
                    and r["kernel"] != "apart"), key=lambda r: r["us"])[:3]
    for best in plain:
        us = graph_us(lambda i, k=best["kernel"]: mlp.launch(*args(i), kernel=k, atomics=False),
                      len(pairs))
        rows.append({"shape": name, "pdl": "stores", "kernel": best["kernel"], "MB": mb,
                     "us": us, "with": best["us"]})
        print(json.dumps(rows[-1]), flush=True)
    # the op's own choice (plain launches: the timed choice's setting outside a graph's block)
    mlp.CHOICES.clear()
    mlp.fused_mlp(*args(0))
    rows.append({"shape": name, "pdl": "choice", "kernel": next(iter(mlp.CHOICES.values())),
                 "MB": mb})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3.5-4b", "qwen3.5-0.8b"])
    parser.add_argument("--kernels", nargs="+", help="these fused forms only (form@tile)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = [row for name in args.shapes for row in shape_rows(name, bandwidth, args.kernels)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {torch.cuda.get_device_name()}")
    for name in args.shapes:
        shape = [r for r in rows if r["shape"] == name]
        print(f"\n{name}: MLP {shape[0]['MB']:.1f} MB, M = 1; choice: "
              f"{[r['kernel'] for r in shape if r['pdl'] == 'choice']}")
        print(f"{'kernel':26} " + " ".join(f"{label:>14}" for label in
                                           ("False", "fp8", "fp8@end")) + "   ulps  repeat")
        for kernel in dict.fromkeys(r["kernel"] for r in shape
                                    if r["pdl"] not in ("choice", "stores")):
            cells, extra = [], ""
            for setting, trigger in PDL_SETTINGS:
                label = fused.pdl_label(setting, trigger)
                row = next(r for r in shape if r["kernel"] == kernel and r["pdl"] == label)
                cells.append(f"{row['us']:7.2f} ({row['of_copy']:.0%})" if "us" in row
                             else "error")
                if "ulps" in row and not extra:
                    extra = f"{row['ulps']:6.1f}  {row['repeat']}"
            print(f"{kernel:26} " + " ".join(f"{c:>14}" for c in cells) + "   " + extra)
        for row in shape:
            if row["pdl"] == "stores":
                print(f"stores, not atomics: {row['kernel']} {row['us']:.2f} us (with atomics: "
                      f"{row['with']:.2f})")
        for row in shape:
            if "error" in row:
                print("error", row["kernel"], row["pdl"], row["error"][:200])


if __name__ == "__main__":
    main()
