"""The verify block's gate-up GEMM and SwiGLU (GPU): the plain pair (the gate-up linear at its
per-shape choice, ops.gemv.small_m_linear, then the activation kernel ops.gemv_swiglu.swiglu_act,
one launch as inductor's fused kernel is) against the one op with the activation in the GEMM's
epilogue (ops.gemv_swiglu.small_m_swiglu, its own per-shape choice), at 9 rows, back to back in
a captured graph over weight copies L2 cannot hold (ops.timing.graph_us).

usage: python bench/swiglu.py [--rows 9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unimax.ops import gemv as ops  # noqa: E402
from unimax.ops import gemv_swiglu as sw  # noqa: E402
from unimax.ops.timing import graph_us, weight_copies  # noqa: E402

SHAPES = {"4b": (9216, 2560), "0.8b": (3584, 1024)}  # (intermediate, hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(2 * n, k, device="cuda") / 30).bfloat16()
        x = torch.randn(args.rows, k, device="cuda").bfloat16()
        copies = weight_copies((w,))
        ops.small_m_linear(x, w)  # (each op's per-shape choice, timed once)
        sw.small_m_swiglu(x, w)
        key = (args.rows, 2 * n, k, torch.bfloat16)
        plain = graph_us(lambda i, x=x, c=copies: sw.swiglu_act(ops.small_m_linear(x, c[i][0])),
                         len(copies))
        fused = graph_us(lambda i, x=x, c=copies: sw.small_m_swiglu(x, c[i][0]), len(copies))
        print(f"{name} ({args.rows} x {k} -> 2 x {n}): plain {ops.CHOICES[key]} + activation "
              f"{plain:.2f} us, one op {sw.CHOICES[key]} {fused:.2f} us")


if __name__ == "__main__":
    main()
