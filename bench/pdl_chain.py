"""Which of the draft step's GEMV boundaries programmatic launch helps (GPU): the full-FP8 draft's
fused GEMVs of every layer back to back, as the engine chooses and launches them, timed in a
graph with PDL off, on everywhere, or on at one kind of boundary only.

Why: on the plain tile of bench/persistent_chain.py, PDL took a 4B chain of FP8 GEMVs 8.5%
faster (a graph boundary 2.1 us, a programmatic one 1.3), yet at 4B every engine decoder times
PDL and keeps plain launches: with it the draft's block is 4% slower, BF16's 5-6%
(bench/RESULTS.md, thirty-fifth session). This bench leaves out what is not a GEMV (the
recurrence, the LM head, the argmax) and the convolution epilogue, keeps each linear's prologue,
residual and timed kernel choice (``fused_small_m_linear``, as ``fused_draft`` calls it), and
asks where the loss is:

- ``off``: every GEMV a plain launch (the 4B engine's choice);
- ``on``: every GEMV launched programmatically, the signal at each program's start (as
  ``fused_gemv.PDL = True``); ``end``: the signal after each program's K loop (auto_pdl's trigger);
- ``on:in``, ``on:out``, ``on:gate_up``, ``on:down``: only that linear launched
  programmatically, i.e. only the boundary before it overlapped (a kernel starts early only if
  it is itself launched so, after a kernel that signals);
- ``on-in``, ``on-out``, ``on-gate_up``, ``on-down``: every linear but that one launched
  programmatically (what a per-linear PDL setting in the engine would run);
- a suffix ``+gap`` (``off+gap``, ``on+gap``): a plain copy kernel between the in- and the
  out-projection, where the engine runs the recurrence (fla's kernel, never programmatic).

Every variant runs the same kernels at the same tiles (the choices are made once, with PDL off),
so their outputs must be bit-equal to ``off``'s; each row says so. On the interpreter, ``--dry``
checks the chain against the torch forms (``fused_small_m_linear_ref``) at a tiny shape.

Measured (thirty-sixth session, H200; bench/RESULTS.md): at 4B ``on`` 1.111x off's time,
``end`` 0.970x, every ``on:``/``on-`` row slower than off; at gdn24-0.8b ``on`` 0.862x, ``end``
0.886x. So the 4B loss was the start signal's (the next grid's programs arriving for the whole
of a multi-wave grid), not a boundary or the kernels between: PDL "auto" now times both
signals (fused_gemv.PDL_TRIGGER).

usage: python bench/pdl_chain.py [--shapes gdn-4b gdn24-0.8b] [--variants off on ...]
       [--json FILE]
       TRITON_INTERPRET=1 python bench/pdl_chain.py --dry
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv import linear_shapes  # noqa: E402

import unimax.ops.fused_gemv as fused_gemv  # noqa: E402
from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops.fused_gemv import fused_small_m_linear, fused_small_m_linear_ref  # noqa: E402

LINEARS = ("in", "out", "gate_up", "down")
VARIANTS = ("off", "on", "end", "on:in", "on:out", "on:gate_up", "on:down", "on-in", "on-out",
            "on-gate_up", "on-down", "off+gap", "on+gap")
EPS = 1e-6


class Layer:
    """One GDN layer's four FP8 linears (weight, per-row scale) and their norms' weights."""

    def __init__(self, cfg, device, g: torch.Generator):
        hidden = cfg.hidden_size
        self.key, self.val, self.head = cfg.key_dim, cfg.value_dim, cfg.head_v_dim
        shapes = linear_shapes(cfg)
        self.dims = {name: shapes[full][:2] for name, full in
                     zip(LINEARS, ("in_proj", "out_proj", "gate_up", "down"), strict=True)}
        self.w, self.s = {}, {}
        for name, (n, k) in self.dims.items():  # (FP8 per row, as the draft's weights)
            self.w[name], self.s[name] = quantize_rows(
                0.02 * torch.randn(n, k, generator=g, device=device))
        self.norm_in = 1.0 + 0.1 * torch.randn(hidden, generator=g, device=device)
        self.norm_mlp = 1.0 + 0.1 * torch.randn(hidden, generator=g, device=device)
        self.norm_gated = 1.0 + 0.1 * torch.randn(self.head, generator=g, device=device)
        for name in ("norm_in", "norm_mlp", "norm_gated"):
            setattr(self, name, getattr(self, name).to(torch.bfloat16))


def linear(layer: Layer, name: str, x, prologue: str, norm=None, z=None, residual=None,
           ref: bool = False):
    n, k = layer.dims[name]
    form = fused_small_m_linear_ref if ref else fused_small_m_linear
    return form(x, layer.w[name], layer.s[name], n, k, prologue, norm, z, residual, EPS, 0.0)


def step(layers: list[Layer], h: torch.Tensor, variant: str = "off",
         ref: bool = False) -> torch.Tensor:
    """h through every layer's four fused GEMVs (the draft's order and prologues), each
    launched as ``variant`` says."""
    base, gap = variant.removesuffix("+gap"), variant.endswith("+gap")
    everywhere = base in ("on", "end")
    only = base.partition(":")[2]
    but = base.partition("-")[2]
    trigger = "end" if base == "end" else "start"

    def run(name, *args, **kw):
        # (fused_gemv.PDL and PDL_TRIGGER are "auto", their defaults: each launch as the block
        # around it says)
        with fused_gemv.auto_pdl(everywhere or only == name or bool(but) and but != name,
                                 trigger):
            return linear(layer, name, *args, ref=ref, **kw)

    for layer in layers:
        proj = run("in", h, "rms", layer.norm_in)
        # the mixer's output would be here (the recurrence): its v channels stand in for it,
        # and its z channels are the gate, both (1, val) views of the projection's row
        v = proj[:, 2 * layer.key: 2 * layer.key + layer.val]
        z = proj[:, 2 * layer.key + layer.val: 2 * layer.key + 2 * layer.val]
        if gap:  # a plain kernel where the recurrence runs
            v = v.clone()
        h = run("out", v, "gated_silu", layer.norm_gated, z=z, residual=h)
        gu = run("gate_up", h, "rms", layer.norm_mlp)
        h = run("down", gu, "swiglu", residual=h)
    return h


def dry_run() -> None:
    """On the interpreter: the chain equals the torch forms' at a tiny GDN shape, in every
    variant (PDL is never asked for there: no PTX)."""
    import dataclasses

    from shapes import SHAPES

    cfg = dataclasses.replace(SHAPES["gdn24-0.8b"], hidden_size=64, intermediate_size=96,
                              num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    g = torch.Generator().manual_seed(0)
    layers = [Layer(cfg, "cpu", g) for _ in range(2)]
    h0 = torch.randn(1, cfg.hidden_size, generator=g).to(torch.bfloat16)
    want = step(layers, h0, ref=True)
    for variant in VARIANTS:
        got = step(layers, h0, variant)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    print(f"the chain agrees with the torch forms in {len(VARIANTS)} variants")


def main() -> None:
    from decode import copy_bandwidth
    from shapes import SHAPES

    from unimax.ops.timing import graph_us

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["gdn-4b", "gdn24-0.8b"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    if args.dry:
        return dry_run()
    copy_gbps = copy_bandwidth() / 1e9
    rows = []
    for name in args.shapes:
        cfg = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        layers = [Layer(cfg, "cuda", g) for _ in range(cfg.num_hidden_layers)]
        h0 = torch.randn(1, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        nbytes = sum(w.numel() for layer in layers for w in layer.w.values())
        floor_us = nbytes / copy_gbps / 1e3
        gemvs = 4 * len(layers)
        with torch.inference_mode():
            want = step(layers, h0, "off")  # (every linear's kernel chosen here, PDL off)
            torch.cuda.synchronize()
            for variant in args.variants:
                got = step(layers, h0, variant)
                us = graph_us(lambda i, v=variant, ls=layers, h=h0: step(ls, h, v), 1)
                row = {"shape": name, "variant": variant, "gemvs": gemvs, "bytes": nbytes,
                       "floor_us": floor_us, "us": us, "same": bool(torch.equal(got, want))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        chosen = sorted({f"{key[0]}{'+res' if key[1] else ''} {key[3]}x{key[4]}: {kernel}"
                         for key, kernel in fused_gemv.CHOICES.items()
                         if key[5] == torch.float8_e4m3fn})
        print(f"{name} choices: " + "; ".join(chosen), flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"copy_GBps": copy_gbps, "rows": rows,
                                         "choices": {str(k): str(v) for k, v in
                                                     fused_gemv.CHOICES.items()}}, indent=1,
                                        default=str))
    print(f"\ncopy {copy_gbps:.0f} GB/s; a chain's time, against off's, and (us - floor) a GEMV")
    print(f"{'shape':12}{'variant':12}{'us':>9}{'x off':>7}{'fixed/gemv':>11}  same")
    base = {r["shape"]: r["us"] for r in rows if r["variant"] == "off"}
    for r in rows:
        ratio = r["us"] / base[r["shape"]] if r["shape"] in base else float("nan")
        print(f"{r['shape']:12}{r['variant']:12}{r['us']:9.1f}{ratio:7.3f}"
              f"{(r['us'] - r['floor_us']) / r['gemvs']:11.2f}  {'yes' if r['same'] else 'NO'}")


if __name__ == "__main__":
    main()
