"""How fast one kernel can read a decode linear's bytes (GPU): the floor under a short GEMV.

The draft's FP8 GEMVs take t0 + bytes / 4.2 TB/s with t0 ~4-5.5 us (bench/RESULTS.md, fifteenth
session: in_proj's 31.6 MB in 12.1-12.7 us, 7.5 us of it bandwidth), and every form tried to
shorten t0 inside the GEMV lost or gained a few percent (PDL, L2 prefetches, whole-K tiles,
two tiles in registers, TMA pipelining). This bench asks what t0 is left with no GEMV at all:
kernels that only read W's bytes (and sum them, so that the reads stay) in the ways the GEMV
forms are built, graph-timed over enough copies that L2 cannot serve them (as the per-shape
choice times), at the 4B linears' sizes and round sizes around them:

- ``one``: a program per 8 KB tile (no loop: the LM head's regime at every size);
- ``chainN``: a program per N tiles in a loop, plain loads (a GEMV program's K loop: in_proj
  has 10 tiles of 256, down 36), each load waited for before the next;
- ``tmaN``: the same through tensor descriptors, pipelined 3 tiles ahead (the TMA forms);
- ``persistP``: P programs per SM over every tile, grid-strided, through descriptors, pipelined
  (a persistent grid: one launch ramp, no tail of short programs);
- ``torch``: torch's sum over the bytes as BF16 (its reduction kernel).

Each variant's t0 and bandwidth come from a least-squares line over the sizes. If ``one`` or
``persist`` reads 12 MB in ~4 us where ``chain10`` takes ~10, the GEMV's t0 is its program
structure (a persistent fused GEMV is worth building); if every variant has t0 ~4 us, it is
the launch and the DRAM ramp, which only fewer kernels remove.

usage: python bench/small_reads.py [--json FILE]
       TRITON_INTERPRET=1 python bench/small_reads.py --dry   (the kernels' sums checked on the
           interpreter at small sizes, nothing timed)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

COLS = 64  # int32 per row: 256 bytes, a GEMV tile's BLOCK_K of FP8
ROWS = 32  # rows per tile: 8 KB, the TMA forms' 32 x 256 FP8 tile
# MiB, round sizes around the 4B draft linears' FP8 weights (out_proj 10.5 MB, down 23.6,
# in_proj 31.6, gate_up 47.2); the fit takes the bytes read
SIZES_MB = (3, 6, 10.5, 12.4, 23.6, 47.2, 96)


@triton.jit
def read_kernel(src, desc, out, rows, chain, ROWS: tl.constexpr, COLS: tl.constexpr,
                TMA: tl.constexpr, STAGES: tl.constexpr, PERSIST: tl.constexpr):
    """Sums (int32, wrapping) the tiles this program reads: ``chain`` consecutive ones from
    its own, or with PERSIST every num_programs-th from its id; one int32 per program out."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(rows, ROWS)
    if PERSIST:
        start = pid
        stop = tiles
        step = tl.num_programs(0)
    else:
        start = pid * chain
        stop = tl.minimum(start + chain, tiles)
        step = 1
    acc = tl.zeros((ROWS, COLS), dtype=tl.int32)
    for t in tl.range(start, stop, step, num_stages=STAGES):
        if TMA:
            v = desc.load([t * ROWS, 0])
        else:
            r = t * ROWS + tl.arange(0, ROWS)
            c = tl.arange(0, COLS)
            v = tl.load(src + r[:, None] * COLS + c[None, :], mask=r[:, None] < rows, other=0)
        acc += v
    tl.store(out + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def variants(sms: int) -> dict[str, dict]:
    """Name -> launch settings (chain: tiles per program; per_sm: persistent programs per SM)."""
    v = {"one": dict(chain=1, tma=False, stages=1)}
    for chain in (10, 36):
        v[f"chain{chain}"] = dict(chain=chain, tma=False, stages=1)
        v[f"tma{chain}"] = dict(chain=chain, tma=True, stages=4)
    for per_sm in (1, 2, 4, 8):
        v[f"persist{per_sm}"] = dict(programs=per_sm * sms, tma=True, stages=4)
    return v


def launcher(words: torch.Tensor, setting: dict):
    """A call reading ``words`` (int32, (rows, COLS)) as ``setting`` says; returns the per-
    program sums (the caller checks their total)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = words.shape[0]
    tiles = triton.cdiv(rows, ROWS)
    persist = "programs" in setting
    grid = ((min(setting["programs"], tiles),) if persist
            else (triton.cdiv(tiles, setting["chain"]),))
    out = torch.empty(grid[0], dtype=torch.int32, device=words.device)
    desc = (TensorDescriptor(words, [rows, COLS], [COLS, 1], [ROWS, COLS]) if setting["tma"]
            else words)

    def call():
        read_kernel[grid](words, desc, out, rows, setting.get("chain", 1), ROWS=ROWS, COLS=COLS,
                          TMA=setting["tma"], STAGES=setting["stages"], PERSIST=persist,
                          num_warps=4)
        return out
    return call


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares us = t0 + bytes / bw over (bytes, us) -> (t0 us, bw GB/s)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(u for _, u in points) / n
    slope = sum((b - mx) * (u - my) for b, u in points) / sum((b - mx) ** 2 for b, _ in points)
    return my - slope * mx, 1e-3 / slope  # (us per byte -> GB/s)


def dry_run() -> None:
    """On the interpreter: every variant's sums equal torch's at sizes with a partial tile."""
    for rows in (ROWS * 5 + 7, ROWS * 40):
        words = torch.randint(-1000, 1000, (rows, COLS), dtype=torch.int32)
        want = int(words.sum())
        for name, setting in variants(sms=3).items():
            got = int(launcher(words, setting)().sum())
            assert got == want, (name, rows, got, want)
    print("every variant reads every byte once")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    if args.dry:
        return dry_run()
    from unimax.ops.timing import graph_us, weight_copies

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    for mb in SIZES_MB:
        rows = int(mb * 2**20) // (COLS * 4)
        base = torch.randint(-1000, 1000, (rows, COLS), dtype=torch.int32, device="cuda")
        copies = [w for (w,) in weight_copies([base])]
        want = int(base.sum())
        for name, setting in variants(sms).items():
            calls = [launcher(w, setting) for w in copies]
            got = int(calls[0]().sum())
            us = graph_us(lambda i, calls=calls: calls[i](), len(calls))
            row = {"variant": name, "MB": mb, "bytes": base.numel() * 4, "us": us,
                   "GBps": base.numel() * 4 / us / 1e3, "sum_ok": got == want}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        halves = [w.view(torch.bfloat16) for w in copies]
        us = graph_us(lambda i, halves=halves: halves[i].sum(dtype=torch.float32), len(halves))
        row = {"variant": "torch", "MB": mb, "bytes": base.numel() * 4, "us": us,
               "GBps": base.numel() * 4 / us / 1e3, "sum_ok": True}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del copies, halves, calls
    names = list(dict.fromkeys(r["variant"] for r in rows_out))
    fits = {}
    for name in names:
        points = [(r["bytes"], r["us"]) for r in rows_out if r["variant"] == name]
        fits[name] = fit(points)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows_out, "fits": fits, "sms": sms}, indent=1))
    print(f"\n{sms} SMs; us per read (graph-timed, L2-cold), then the fit t0 + bytes / bw")
    print(f"{'variant':10}" + "".join(f"{mb:>8}" for mb in SIZES_MB) + f"{'t0 us':>8}{'GB/s':>7}")
    for name in names:
        us = {r["MB"]: r for r in rows_out if r["variant"] == name}
        bad = "" if all(r["sum_ok"] for r in us.values()) else "  SUM WRONG"
        print(f"{name:10}" + "".join(f"{us[mb]['us']:8.2f}" for mb in SIZES_MB)
              + f"{fits[name][0]:8.2f}{fits[name][1]:7.0f}{bad}")


if __name__ == "__main__":
    main()
