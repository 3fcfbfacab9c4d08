"""Where a long prefill's time goes (GPU): the kernels of one ``prefill_exact`` (what a reply
waits for), grouped by name, and how much of the prefill the GPU is busy.

usage: python bench/profile_prefill.py [--shapes qwen3.5-0.8b] [--lengths 4096 16384]
       [--torch-norms] [--json FILE]
Random weights, BF16, batch 1, a fresh conversation. Per length: the median device time of
prefill_exact (after two warm-ups: fla's autotuning, the allocator), the kernels' summed time
(``busy``; wall minus busy is launch gaps and host work) and the top kernels with their share.
Issue 15's lever: a 16k prefill at 0.8B is ~35 ms of compute, measured at ~115 ms.
--torch-norms: each length again with the norms and SwiGLU as torch forms instead of fla's fused
kernels (unimax.norms.FLA_PROMPT_KERNELS off), in the same process, so the two rows compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import median_device_seconds  # noqa: E402
from profile_step import kernel_table  # noqa: E402
from shapes import SHAPES  # noqa: E402

import unimax.norms  # noqa: E402
from unimax import GDNForCausalLM, build_engine  # noqa: E402


@torch.inference_mode()
def profile_length(engine, length: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, length), device="cuda")
    run = lambda: engine.prefill_exact(ids)  # noqa: E731
    wall = median_device_seconds(run, 5, warmup=2)
    rows, busy, count = kernel_table(run, per=1)
    return {"tokens": length, "ms": wall * 1e3, "busy_ms": busy / 1e3, "kernels": count,
            "kernels_top": rows[:30]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3.5-0.8b"], choices=list(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--torch-norms", action="store_true",
                        help="each length also with the torch forms of the norms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = []
    for shape in args.shapes:
        cfg = dataclasses.replace(SHAPES[shape], max_context=max(args.lengths) + 512)
        model = GDNForCausalLM.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
        engine = build_engine(model, decode="bf16")
        default = unimax.norms.FLA_PROMPT_KERNELS
        for length in args.lengths:
            for fla in (default, not default) if args.torch_norms else (default,):
                unimax.norms.FLA_PROMPT_KERNELS = fla
                try:
                    row = {"shape": shape, "fla_norms": fla,
                           **profile_length(engine, length, cfg.vocab_size)}
                except Exception as err:  # record, keep profiling
                    row = {"shape": shape, "tokens": length, "fla_norms": fla,
                           "error": repr(err)[:300]}
                finally:
                    unimax.norms.FLA_PROMPT_KERNELS = default
                report.append(row)
                print(json.dumps(row)[:400], flush=True)
        del engine, model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    for row in report:
        if "error" in row:
            print(f"{row['shape']} {row['tokens']}: error {row['error'][:200]}")
            continue
        fla = "" if row["fla_norms"] else ", torch norms"
        print(f"\n{row['shape']} {row['tokens']} tokens{fla}: {row['ms']:.1f} ms, kernels busy "
              f"{row['busy_ms']:.1f} ms, {row['kernels']:.0f} kernels")
        busy = max(row["busy_ms"], 1e-9)
        for k in row["kernels_top"][:22]:
            print(f"  {k['us'] / 1e3:7.2f} ms {100 * k['us'] / 1e3 / busy:5.1f}% "
                  f"{k['calls']:5.0f}x  {k['name'][:90]}")


if __name__ == "__main__":
    main()
