"""The gate-up product with its SwiGLU as one op (unimax.ops.gemv_swiglu) against its plain twin,
on the CPU through Triton's interpreter (a child process) and compiled for sm_90 / sm_89; the
verifier view's MLPs that run it (unimax.fast_step.GemvSwiGLUMLP)."""

import pytest
import torch

from helpers import run_with_triton
from unimax import GDNForCausalLM
from unimax.fast_step import GemvLinear, GemvSwiGLUMLP, gemv_view
from unimax.fp8 import quantize_view
from unimax.layers import SwiGLUMLP
from unimax.ops.gemv_swiglu import gemv_swiglu, swiglu_ref
from unimax.tiny import TINY_CONFIG

CHILD = """
import torch
import torch.nn.functional as F
from unimax.fp8 import quantize_rows
from unimax.ops.gemv import TILES, tile_text
from unimax.ops.gemv_swiglu import gemv_swiglu, small_m_swiglu, swiglu_act, swiglu_ref

def trunc(t):
    # Triton's interpreter turns fp32 into BF16 by dropping bits, where a GPU rounds to
    # nearest: its twin rounds so, to check where the forms round, step by step
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

def trunc_twin(x, w, s=None):
    y = x.float() @ w.float().t()
    gate, up = trunc(y if s is None else y * s[None, :]).float().chunk(2, dim=-1)
    return trunc(trunc(F.silu(gate)).float() * up)

def report(tag, y, r, t):
    # against the twin: the size of the difference; against the interpreter's twin: the share
    # of elements off, which only the fp32 products' summation order may move
    assert y.shape == r.shape == t.shape and y.dtype == torch.bfloat16, (tag, y.shape)
    err = float((y.float() - r.float()).norm() / r.float().norm())
    print(tag.replace(" ", "_"), f"{err:.2e}", f"{float((y != t).float().mean()):.4f}")

torch.manual_seed(0)
for m, n, k in [(9, 70, 300), (5, 33, 130), (16, 40, 64), (1, 100, 96), (9, 17, 1000),
                (17, 40, 300), (32, 33, 130)]:  # (the last two: 32-row tiles)
    w = torch.randn(2 * n, k)
    q, s = quantize_rows(w)
    x = torch.randn(m, k).to(torch.bfloat16)
    for name, args in (("bf16", (w.to(torch.bfloat16), None)), ("fp8", (q, s))):
        r, t = swiglu_ref(x, *args), trunc_twin(x, *args)
        report(f"dot {name} {m}x{n}x{k}", gemv_swiglu(x, *args), r, t)
        report(f"op {name} {m}x{n}x{k}", small_m_swiglu(x, *args), r, t)
x, w = torch.randn(9, 300).to(torch.bfloat16), torch.randn(140, 300).to(torch.bfloat16)
for tile in (TILES["dot"][0], TILES["dot"][-1]):
    report(f"tile {tile_text(tile)}", gemv_swiglu(x, w, None, f"dot@{tile_text(tile)}"),
           swiglu_ref(x, w), trunc_twin(x, w))
# cuBLAS's product (here torch's, rounded to nearest) and the activation kernel after it
gu = F.linear(x, w)
report("cublas", gemv_swiglu(x, w, None, "cublas"), swiglu_ref(x, w),
       trunc(trunc(F.silu(gu[:, :70].float())).float() * gu[:, 70:].float()))
# the activation kernel alone, where silu's own rounding matters: none off
gu = (torch.randn(7, 2 * 3000) * 4).to(torch.bfloat16)
g, u = gu[:, :3000], gu[:, 3000:]
report("act", swiglu_act(gu), F.silu(g) * u, trunc(trunc(F.silu(g.float())).float() * u.float()))
# without silu's rounding before the product: the check sees it
report("unrounded", trunc(F.silu(g.float()) * u.float()), F.silu(g) * u,
       trunc(trunc(F.silu(g.float())).float() * u.float()))
traced = torch.compile(lambda x, w: small_m_swiglu(x, w) * 2, fullgraph=True, backend="eager")
print("compiled", float((traced(x, w) - 2 * small_m_swiglu(x, w)).abs().max()), 0)
"""


def test_gemv_swiglu_matches_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    rows = {tag: (float(err), float(off))
            for tag, err, off in (line.split() for line in out.strip().splitlines())}
    assert len(rows) == 7 * 4 + 2 + 4, out
    assert rows.pop("compiled") == (0.0, 0.0), out  # the op's fake: no graph break
    assert rows.pop("act")[1] == 0.0, out  # where each form rounds, step by step
    assert rows.pop("unrounded")[1] > 0.05, out  # (a missing step shows in many elements)
    for tag, (err, off) in rows.items():
        assert err < 2e-2, (tag, err, out)  # (BF16 truncated twice, against rounded)
        assert off < 0.005, (tag, off, out)  # the products' fp32 summation order only


def test_gemv_swiglu_names_bad_input():
    x, w = torch.randn(9, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    with pytest.raises(ValueError, match="even"):
        gemv_swiglu(x, w[:39])
    with pytest.raises(ValueError, match=r"\(M, K\) and \(2N, K\)"):
        gemv_swiglu(x, w[:, :32])
    with pytest.raises(ValueError, match="cublas is for BF16"):
        gemv_swiglu(x, w, torch.ones(40), "cublas")
    with pytest.raises(ValueError, match="dot"):
        gemv_swiglu(x, w, None, "rows")


def test_swiglu_twin_is_the_mlps_own_activation():
    """The twin is what the exact model's MLP computes before its down-projection."""
    mlp = SwiGLUMLP(64, 48).to(torch.bfloat16)
    x = torch.randn(9, 64).bfloat16()
    gate, up = mlp.gate_up_proj(x).split(48, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).detach()
    got = swiglu_ref(x, mlp.gate_up_proj.weight.detach())
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_the_view_takes_bf16_mlps_only_and_keeps_the_plain_path_off_cuda():
    model = GDNForCausalLM.random(TINY_CONFIG, seed=0)
    view = gemv_view(model, fuse=False)
    for block, own in zip(view.layers, model.layers, strict=True):
        assert type(block.mlp) is GemvSwiGLUMLP and type(own.mlp) is SwiGLUMLP
        assert isinstance(block.mlp.gate_up_proj, GemvLinear)
        assert block.mlp.gate_up_proj.weight is own.mlp.gate_up_proj.weight
        assert block.mlp.down_proj.weight is own.mlp.down_proj.weight
        x = torch.randn(1, 9, TINY_CONFIG.hidden_size)
        assert torch.equal(block.mlp(x), own.mlp(x))  # the CPU: the plain MLP
    # a full-FP8 view's MLPs are FP8 linears: theirs stay as they were
    draft = gemv_view(quantize_view(model, "full"), fuse=False)
    assert all(type(block.mlp) is SwiGLUMLP for block in draft.layers)
    # the tail view: its last MLP is FP8, the others BF16
    tail = gemv_view(quantize_view(model, "tail"), fuse=False)
    kinds = [type(block.mlp) for block in tail.layers]
    assert kinds == [GemvSwiGLUMLP] * (len(kinds) - 1) + [SwiGLUMLP]
