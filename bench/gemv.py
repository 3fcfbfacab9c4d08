"""The decode linears one at a time (GPU): each weight shape of a model at M = 1 (a decode step)
and M = 9 (a verifier block of 8), BF16 and FP8 weights, through the Triton kernels of
unimax.ops.gemv (the default per M; the tensor-core kernel at M = 1 too; the GEMV with FP16
products for FP8; split-K on the tensor cores, "dotsplit", where offered: its fastest tile),
cuBLAS for BF16,
in CUDA-graph replays over enough weight copies that L2 cannot serve them. Prints the time and
the fraction of the copy bandwidth per shape, and the sum over one decode step's linears.

usage: python bench/gemv.py [--shape gdn-4b] [--json FILE]
       python bench/gemv.py --tiles [in_proj out_proj gate_up down] [--shape gdn-4b]   the FP8
           GEMV (rows and rows16) at M = 1 on those linears (default: the K-long out_proj and
           down, 45-60% of copy bandwidth where the wide ones reach 75-80%) over a wider tile
           space than GEMV_TILES, num_stages included, each tile launched as is: whether a
           tile closes the gap (then GEMV_TILES takes it)
       python bench/gemv.py --fused [--shape gdn-4b]   the draft's fused FP8 GEMVs (the
           prologue and residual each linear has in unimax.fused_draft) at M = 1 through every
           form: rows, rows16 and the split-K forms split, split16 (each autotuned), and which
           form and tile the per-shape timed choice takes, timed the same way
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops import gemv as gemv_mod  # noqa: E402
from unimax.ops.timing import graph_us, weight_copies  # noqa: E402


def linear_shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, calls per decode step) for a pure-GDN config."""
    layers = cfg.num_hidden_layers
    return {"in_proj": (sum(cfg.in_proj_sizes), cfg.hidden_size, layers),
            "out_proj": (cfg.hidden_size, cfg.value_dim, layers),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, layers),
            "down": (cfg.hidden_size, cfg.intermediate_size, layers),
            "lm_head": (cfg.vocab_size, cfg.hidden_size, 1)}


def bench_copies(weight, scale) -> list[tuple]:
    """The weight (and its scale) and clones up to 400 MB, at most 64: each replay reads them
    from memory, never from L2 (ops.timing.weight_copies, with more bytes than a choice's)."""
    return weight_copies((weight, scale), 400_000_000)[:64]


def run_shape(name, n, k, m, kind, bandwidth) -> dict:
    torch.manual_seed(0)
    base = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = bench_copies(*quantize_rows(base)) if kind == "fp8" else bench_copies(base, None)
    copies, weight_bytes = len(weights), weights[0][0].nbytes
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row = {"name": name, "kind": kind, "M": m, "N": n, "K": k, "MB": weight_bytes / 1e6}
    variants = {"triton": lambda i: gemv_mod.gemv(x, *weights[i])}
    if m <= gemv_mod.PROGRAM_ROWS:
        variants["dot"] = lambda i: gemv_mod.gemv(x, *weights[i], kernel="dot")
        if kind == "fp8":
            variants["rows16"] = lambda i: gemv_mod.gemv(x, *weights[i], kernel="rows16")
    if kind == "bf16":
        variants["cublas"] = lambda i: F.linear(x, weights[i][0])
    if gemv_mod.dotsplit_fits(m, n, k):  # (the verifier's narrow K-long linears: each tile)
        for tile in gemv_mod.DOTSPLIT_TILES:
            name = f"dotsplit@{gemv_mod.tile_text(tile)}"
            variants[name] = lambda i, name=name: gemv_mod.gemv(x, *weights[i], kernel=name)
    for label, fn in variants.items():
        us = graph_us(fn, copies)
        row[label + "_us"] = us
        row[label + "_bw"] = weight_bytes / (us * 1e-6) / bandwidth
    split = [label for label in variants if label.startswith("dotsplit@")]
    if split:  # (the table's column: the fastest tile)
        best = min(split, key=lambda label: row[label + "_us"])
        row.update(dotsplit_us=row[best + "_us"], dotsplit_bw=row[best + "_bw"],
                   dotsplit_tile=best)
    return row


# (BLOCK_N, BLOCK_K, warps, stages) swept by --tiles, per K (BLOCK_K past K wastes lanes, well
# under it adds iterations); GEMV_TILES leaves stages to Triton
def sweep(k: int) -> list[tuple[int, int, int, int]]:
    widths = (256, 512, 1024) if k <= 4096 else (512, 1024, 2048)
    return [(n, bk, w, st) for n in (2, 4, 8, 16) for bk in widths for w in (4, 8)
            for st in (1, 3, 5)]


def autotuned_tile(f16: bool, n: int, k: int) -> list | None:
    """The tile [BLOCK_N, BLOCK_K, warps, stages] Triton's autotuner chose for the FP8 GEMV at
    (N, K): where the sweep's best differs, its timing (do_bench, one launch after an L2
    flush) and a graph's replays disagree (gate_up with FP16 products, 2026-12-01: 17.8 us
    autotuned against 14.4 for the best tile)."""
    tuner = gemv_mod._gemv_kernel(True, f16)[1]
    for key, config in getattr(tuner, "cache", {}).items():
        if tuple(key[:2]) == (n, k):
            return [config.kwargs.get("BLOCK_N"), config.kwargs.get("BLOCK_K"),
                    config.num_warps, config.num_stages]
    return None


def sweep_tiles(name, n, k, bandwidth) -> list[dict]:
    """Each SWEEP tile of the FP8 GEMV (fp32 and FP16 products) for one (N, K) at M = 1, and
    the autotuned choice beside it."""
    from unimax.ops.gemv_kernels import gemv_kernel

    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    weights = bench_copies(q, scale)
    copies = len(weights)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for f16 in (False, True):
        auto = graph_us(lambda i, f16=f16: gemv_mod.gemv(x, *weights[i],
                                                         kernel="rows16" if f16 else "rows"),
                        copies)
        chosen = autotuned_tile(f16, n, k)
        for bn, bk, warps, stages in sweep(k):
            def launch(i, bn=bn, bk=bk, warps=warps, stages=stages, f16=f16):
                w, s = weights[i]
                gemv_kernel[(-(-n // bn), 1)](x, w, s, y, n, k, x.stride(0), w.stride(0),
                                             y.stride(0), HAS_SCALE=True, BLOCK_N=bn,
                                             BLOCK_K=bk, F16=f16, num_warps=warps,
                                             num_stages=stages)
            try:
                us = graph_us(launch, copies)
            except Exception as e:  # (a tile past the registers or shared memory)
                us = float("nan")
                print(f"{name} {bn}x{bk} w{warps} s{stages}: {type(e).__name__}", flush=True)
            rows.append({"name": name, "N": n, "K": k, "f16": f16, "tile": [bn, bk, warps, stages],
                         "us": us, "bw": q.numel() / (us * 1e-6) / bandwidth,
                         "autotuned_us": auto, "autotuned_tile": chosen})
    return rows


def tiles_main(args, bandwidth) -> None:
    shapes = linear_shapes(SHAPES[args.shape])
    names = args.tiles
    rows = []
    for name in names:  # each linear's rows as they come (a call cut short keeps them)
        rows += sweep_tiles(name, *shapes[name][:2], bandwidth)
        print(json.dumps([r for r in rows if r["name"] == name]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; FP8 GEMV tiles at M = 1, shape "
          f"{args.shape}: the five fastest per linear and products, beside the autotuned one")
    for name in names:
        for f16 in (False, True):
            sel = sorted((r for r in rows if r["name"] == name and r["f16"] == f16
                          and r["us"] == r["us"]), key=lambda r: r["us"])
            auto = sel[0]["autotuned_us"] if sel else float("nan")
            chosen = sel[0]["autotuned_tile"] if sel else None
            best = ", ".join(f"{r['tile']} {r['us']:.2f} ({r['bw']:.2f})" for r in sel[:5])
            print(f"{name} {'rows16' if f16 else 'rows'}: autotuned {chosen} {auto:.2f} us; "
                  f"{best}")


# Each draft linear's fold (unimax.fused_draft): prologue, residual added, x's width factor
FOLDS = {"in_proj": ("rms", False, 1), "out_proj": ("gated_silu", True, 1),
         "gate_up": ("rms", False, 1), "down": ("swiglu", True, 2)}


def fold_inputs(cfg, name: str, n: int, k: int):
    """A draft linear's fused GEMV inputs at M = 1 (FP8 weight copies, x, z, the norm's
    weight, the residual) as unimax.fused_draft calls it: (prologue, head, weights, q, x, z,
    norm, res)."""
    prologue, residual, width = FOLDS[name]
    torch.manual_seed(0)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(1, width * k, device="cuda", dtype=torch.bfloat16)
    gated = prologue.startswith("gated")
    head = cfg.head_v_dim if gated else 1
    z = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if gated else None
    norm = (torch.ones(head if gated else k, device="cuda", dtype=torch.bfloat16)
            if prologue != "swiglu" else None)
    res = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if residual else None
    return prologue, head, bench_copies(q, scale), q, x, z, norm, res


def fused_row(cfg, name: str, n: int, k: int, bandwidth: float) -> dict:
    """One draft linear's fused FP8 GEMV (M = 1) through every form, and the timed choice."""
    from unimax.ops import fused_gemv as fused

    prologue, _, weights, q, x, z, norm, res = fold_inputs(cfg, name, n, k)
    scale = weights[0][1]
    copies = len(weights)
    row = {"name": name, "N": n, "K": k, "prologue": prologue, "MB": q.numel() / 1e6}
    forms = ("rows", "rows16") + (("split", "split16") if fused.split_fits(n, k, 1, True)
                                  else ())
    for form in forms:
        us = graph_us(lambda i, form=form: fused.fused_gemv(
            x, *weights[i], n, k, prologue, norm, z, res, kernel=form), copies)
        row[form + "_us"], row[form + "_bw"] = us, q.numel() / (us * 1e-6) / bandwidth
    fused.fused_small_m_linear(x, q, scale, n, k, prologue, norm, z, res, 1e-6, 0.0)
    row["chosen"] = next((v for key, v in fused.CHOICES.items() if key[3:5] == (n, k)), None)
    if row["chosen"]:  # the chosen form and tile, timed here as the forms were
        us = graph_us(lambda i: fused.fused_gemv(x, *weights[i], n, k, prologue, norm, z, res,
                                                 kernel=row["chosen"]), copies)
        row["chosen_us"], row["chosen_bw"] = us, q.numel() / (us * 1e-6) / bandwidth
    return row


def fused_main(args, bandwidth) -> None:
    """Every fused GEMV form per draft linear (FP8, M = 1), graph-timed over weight copies."""
    cfg = SHAPES[args.shape]
    rows = []
    for name, (n, k, _) in linear_shapes(cfg).items():
        if name in FOLDS:
            rows.append(fused_row(cfg, name, n, k, bandwidth))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; fused FP8 GEMVs at M = 1, shape "
          f"{args.shape}: us (fraction of copy bandwidth), and the timed choice")
    for r in rows:
        forms = "  ".join(f"{f} {r[f + '_us']:.2f} ({r[f + '_bw']:.2f})"
                          for f in ("rows", "rows16", "split", "split16") if f + "_us" in r)
        chosen = (f" {r['chosen_us']:.2f} ({r['chosen_bw']:.2f})" if "chosen_us" in r else "")
        print(f"{r['name']:9} {r['N']:>6}x{r['K']:<6} {forms}  chosen: {r['chosen']}{chosen}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gdn-4b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    parser.add_argument("--tiles", nargs="*", choices=("in_proj", "out_proj", "gate_up", "down"),
                        help="sweep the FP8 GEMV's tiles on these linears (none named: "
                             "out_proj down)")
    parser.add_argument("--fused", action="store_true",
                        help="the draft's fused FP8 GEMVs through every form (split-K too)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    if args.fused:
        return fused_main(args, bandwidth)
    if args.tiles is not None:
        args.tiles = args.tiles or ["out_proj", "down"]
        return tiles_main(args, bandwidth)
    shapes = linear_shapes(SHAPES[args.shape])
    rows = []
    for kind in ("fp8", "bf16"):
        for m in args.rows:
            for name, (n, k, calls) in shapes.items():
                row = {**run_shape(name, n, k, m, kind, bandwidth), "calls": calls}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; shape {args.shape}; "
          "us per call (fraction of copy bandwidth)")
    labels = ("triton", "rows16", "dot", "dotsplit", "cublas")
    print(f"{'kind':5} {'M':>2} {'linear':9} {'MB':>7} " + "".join(f"{x:>20}" for x in labels))
    for r in rows:
        cells = "".join(f"{r[x + '_us']:>11.1f} ({r[x + '_bw']:.2f})" if x + "_us" in r
                        else f"{'-':>20}" for x in labels)
        print(f"{r['kind']:5} {r['M']:>2} {r['name']:9} {r['MB']:>7.1f} {cells}")
    for kind in ("fp8", "bf16"):
        for m in args.rows:
            sel = [r for r in rows if r["kind"] == kind and r["M"] == m]
            total = {x: sum(r[x + "_us"] * r["calls"] for r in sel)
                     for x in labels if all(x + "_us" in r for r in sel)}
            best = sum(min(r[x + "_us"] for x in labels if x + "_us" in r) * r["calls"]
                       for r in sel)
            print(f"per step, {kind} M={m}: " + ", ".join(f"{x} {v:.0f} us"
                                                         for x, v in total.items())
                  + f", best per shape {best:.0f} us")


if __name__ == "__main__":
    main()
