"""fla's fused recurrent kernel at decode's token counts (GPU): launch settings side by side.

usage: python bench/recurrent.py [--heads 16x32 16x16] [--tokens 1 9] [--json FILE]
       python bench/recurrent.py --short [--heads 16x32 16x16] [--json FILE]

The decode step runs it for one token per GDN layer (unimax.ops.decode_step, 3.5 us per 4B
layer on the H200, where reading and writing the 2 MB state takes ~1 us at copy bandwidth); the
verifier for k + 1 tokens (17 us per layer at 9). fla launches it with BV = 8 value columns per
program and one warp; this times other tiles (BV), warps and stages on the same inputs, each
as a CUDA graph of one launch per layer over 32 layers' own states (64 MB at the 4B heads: more
than the L2 holds, as in a step). Prints us per launch and the state's share of copy bandwidth.

``--short``: the few-token op (unimax.ops.short_recurrence) instead: fla's kernel and ours at
each of its launch settings, as its timed choice times them (ops.timing.graph_us, over input
copies), for the verifier's block (1 sequence, 9 and 17 tokens, no final state) and its rewind
(32 layers as the batch, 9 tokens, the final state written), with the difference of each from
fla's outputs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth, median_device_seconds  # noqa: E402

from unimax.ops.decode_step import launch_recurrent  # noqa: E402

LAYERS = 32
DIM = 128  # head_k_dim = head_v_dim of every Qwen3.5 / GDN shape in bench/shapes.py


def inputs(key_heads: int, value_heads: int, tokens: int, gen: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = (randn(1, tokens, key_heads, DIM).to(torch.bfloat16) for _ in range(2))
    v = randn(1, tokens, value_heads, DIM).to(torch.bfloat16)
    a = randn(1, tokens, value_heads).to(torch.bfloat16)
    beta = torch.rand(1, tokens, value_heads, device="cuda", generator=gen).to(torch.bfloat16)
    A_log, dt_bias = randn(value_heads), randn(value_heads)
    states = [randn(1, value_heads, DIM, DIM) * 0.1 for _ in range(LAYERS)]
    return (q, k, v, a, beta), states, (A_log, dt_bias)


@torch.inference_mode()
def time_setting(key_heads, value_heads, tokens, block_v, warps, stages) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    (q, k, v, a, beta), states, (A_log, dt_bias) = inputs(key_heads, value_heads, tokens, gen)
    reference = [s.clone() for s in states]
    def run():
        return [launch_recurrent(q, k, v, a, beta, s, A_log, dt_bias, block_v=block_v,
                                 num_warps=warps, num_stages=stages) for s in states]

    outs = run()  # compiles; checked against fla's own settings below
    ref_outs = [launch_recurrent(q, k, v, a, beta, s, A_log, dt_bias) for s in reference]
    err = max(float((x - y).abs().max()) for x, y in zip(states + outs, reference + ref_outs,
                                                         strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    seconds = median_device_seconds(graph.replay, 20, warmup=3) / LAYERS
    return {"heads": f"{key_heads}x{value_heads}", "tokens": tokens, "block_v": block_v,
            "warps": warps, "stages": stages, "us": seconds * 1e6, "max_diff_vs_fla": err,
            "state_bytes": 2 * value_heads * DIM * DIM * 4}


@torch.inference_mode()
def short_rows(heads: str) -> list[dict]:
    """fla's kernel and ours at every launch setting, per few-token shape (see --short)."""
    from unimax.ops import short_recurrence as short
    from unimax.ops.timing import graph_us, weight_copies

    key_heads, value_heads = (int(x) for x in heads.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, tokens, final in ((1, 9, False), (1, 17, False), (LAYERS, 9, True)):
        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q, k = (randn(batch, tokens, key_heads, DIM).bfloat16() for _ in range(2))
        v = randn(batch, tokens, value_heads, DIM).bfloat16()
        g = -torch.rand(batch, tokens, value_heads, device="cuda", generator=gen)
        beta = torch.rand(batch, tokens, value_heads, device="cuda", generator=gen).bfloat16()
        h0 = randn(batch, value_heads, DIM, DIM) * 0.1
        copies = weight_copies((q, k, v, g, beta, h0))
        ref, _ = short.run("fla", q, k, v, g, beta, h0, final)
        for name in short.names():
            out, _ = short.run(name, q, k, v, g, beta, h0, final)
            us = graph_us(lambda i, name=name, copies=copies, final=final: short.run(
                name, *copies[i], final), len(copies))
            rows.append({"heads": heads, "batch": batch, "tokens": tokens, "kernel": name,
                         "us": us, "max_diff_vs_fla": float((out.float() - ref.float()).abs()
                                                            .max())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def short_main(args) -> None:
    rows = [row for heads in args.heads for row in short_rows(heads)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\nthe few-token op's candidates (us per launch, graph-timed; diff: max |o - fla's|)")
    for _, members in itertools.groupby(rows, key=lambda r: (r["heads"], r["batch"],
                                                             r["tokens"])):
        members = list(members)
        fla = next(r["us"] for r in members if r["kernel"] == "fla")
        best = min(members, key=lambda r: r["us"])
        line = "  ".join(f"{r['kernel'].removeprefix('short@')} {r['us']:.2f}" for r in members)
        print(f"{members[0]['heads']} B{members[0]['batch']} T{members[0]['tokens']}: {line}"
              f"  -> best {best['kernel']} {best['us']:.2f} ({fla / best['us']:.2f}x fla), "
              f"diff {max(r['max_diff_vs_fla'] for r in members):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", nargs="+", default=["16x32", "16x16"],
                        help="key x value heads (gdn-4b: 16x32; Qwen3.5-0.8B: 16x16)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 9])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--short", action="store_true",
                        help="time the few-token op's candidates instead")
    args = parser.parse_args()
    if args.short:
        return short_main(args)
    bandwidth = copy_bandwidth()
    rows = []
    for heads, tokens in itertools.product(args.heads, args.tokens):
        key_heads, value_heads = (int(x) for x in heads.split("x"))
        for block_v, warps, stages in itertools.product((4, 8, 16, 32), (1, 2, 4), (1, 3)):
            try:
                row = time_setting(key_heads, value_heads, tokens, block_v, warps, stages)
            except Exception as err:  # record, go on
                row = {"heads": heads, "tokens": tokens, "block_v": block_v, "warps": warps,
                       "stages": stages, "error": repr(err)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; fla's setting: BV 8, 1 warp, 3 stages")
    print(f"{'heads':>6}{'T':>4}{'BV':>4}{'warps':>6}{'stages':>7}{'us':>8}{'of copy':>9}"
          f"{'diff':>9}")
    timed = sorted((r for r in rows if "error" not in r),
                   key=lambda r: (r["heads"], r["tokens"], r["us"]))
    for _, members in itertools.groupby(timed, key=lambda r: (r["heads"], r["tokens"])):
        members = list(members)  # the 5 fastest, and fla's own setting wherever it ranks
        shown = members[:5] + [r for r in members[5:] if (r["block_v"], r["warps"],
                                                          r["stages"]) == (8, 1, 3)]
        for r in shown:
            print_row(r, bandwidth)
    print(f"errors: {sum('error' in r for r in rows)} of {len(rows)} settings")


def print_row(r: dict, bandwidth: float) -> None:
    share = r["state_bytes"] / bandwidth / (r["us"] * 1e-6)  # the state's bytes at copy speed
    print(f"{r['heads']:>6}{r['tokens']:>4}{r['block_v']:>4}{r['warps']:>6}{r['stages']:>7}"
          f"{r['us']:>8.2f}{share:>9.2f}{r['max_diff_vs_fla']:>9.1e}")


if __name__ == "__main__":
    main()
