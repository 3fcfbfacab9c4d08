"""The int4 draft's kernels (ops.int4_gemv, ops.int4_fused) against their twins in Triton's
interpreter (the PTX dequantizer swapped for integer arithmetic there: its values are checked
on the GPU, tests/test_gpu_int4.py), and the fused int4 draft view (unimax.fused_draft)
against the unfused one on the CPU, where the ops run their twins."""

import torch
from test_fused_draft import steps

import unimax.fused_draft as fused_draft
from helpers import run_with_triton, spied
from unimax.fast_step import gemv_view
from unimax.fp8 import quantize_view
from unimax.int4 import Int4Linear

CHILD = """
import torch
from unimax.int4 import quantize_packed
from unimax.ops import int4_gemv
from unimax.ops.int4_fused import (int4_fused, int4_fused_linear, int4_fused_ref,
                                   int4_in_proj_conv)
def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())
torch.manual_seed(0)
# the GEMV on x ready, each tile of a shape, against the twin (and the sign read)
for n, k, group in ((70, 256, 64), (33, 384, 128)):
    packed, scale = quantize_packed(torch.randn(n, k), group)
    ready = int4_gemv.prepare_x(torch.randn(1, k))
    ref = int4_gemv.int4_matvec_ref(ready, packed, scale, torch.float32)
    for tile in int4_gemv.tiles_for(k, group)[-3:]:
        assert rel(int4_gemv.launch(ready, packed, scale, torch.float32, tile), ref) < 2e-3
    print("gemv ok", n, k)
# the fused kernel: every prologue, with and without the residual, fp32 and bf16, two tiles;
# x made ready by one program (K 256), and by three, the last one's slice cut short (K 320,
# slices of 128: each program takes RMSNorm's factor over the whole row itself)
import itertools
from unimax.ops import int4_fused as fused_mod
for dtype, (k, pre_block, tiles) in itertools.product(
        (torch.float32, torch.bfloat16),
        ((256, 1024, ((16, 64, 4), (4, 256, 4))), (320, 128, ((16, 64, 4), (8, 64, 4))))):
    fused_mod.PRE_BLOCK = pre_block
    n, head = 70, 64
    packed, scale = quantize_packed(torch.randn(n, k), 64)
    for prologue in ("none", "rms", "gated_silu", "gated_sigmoid", "swiglu", "sigmoid_gate"):
        gated = prologue.startswith("gated")
        x = (3 * torch.randn(1, 2 * k if prologue == "swiglu" else k)).to(dtype)
        z = torch.randn(1, k).to(dtype) if gated or prologue == "sigmoid_gate" else None
        norm = (1 + 0.1 * torch.randn(head if gated else k)).to(dtype) \\
            if prologue in ("rms", "gated_silu", "gated_sigmoid") else None
        offset = 1.0 if prologue == "rms" else 0.0
        for res in (None, torch.randn(1, n).to(dtype)):
            ref = int4_fused_ref(x, packed, scale, prologue, norm, z, res, 1e-6, offset)
            for tile in tiles:
                y = int4_fused(x, packed, scale, prologue, norm, z, res, 1e-6, offset,
                               tile=tile)
                assert y.shape == (1, n) and y.dtype == dtype
                assert rel(y, ref) < (2e-3 if dtype == torch.float32 else 2e-2), (
                    dtype, k, prologue, res is None, tile, rel(y, ref))
            # (the op takes the twin on the CPU: the same numbers)
            assert torch.equal(int4_fused_linear(x, packed, scale, prologue, norm, z, res,
                                                 1e-6, offset), ref)
    print("fused ok", dtype, k)
fused_mod.PRE_BLOCK = 1024
# the in-projection with the convolution and beta folded in: the window rolled in place
for dtype in (torch.float32, torch.bfloat16):
    packed, scale = quantize_packed(torch.randn(100, 256), 128)
    x = (3 * torch.randn(1, 256)).to(dtype)
    norm, conv_w = (1 + 0.1 * torch.randn(256)).to(dtype), torch.randn(64, 4).to(dtype)
    state = torch.randn(1, 64, 4).to(dtype)
    for beta in (None, (80, 4, False), (90, 4, True)):
        got_state, want_state = state.clone(), state.clone()
        got = int4_fused(x, packed, scale, "rms", norm, None, None, 1e-6, 1.0, got_state,
                         conv_w, beta)
        want = int4_fused_ref(x, packed, scale, "rms", norm, None, None, 1e-6, 1.0, want_state,
                              conv_w, beta)
        assert rel(got, want) < (2e-3 if dtype == torch.float32 else 2e-2), (dtype, beta)
        assert torch.equal(got_state[..., :3], state[..., 1:])  # (the window rolled)
        assert rel(got_state[..., 3], want_state[..., 3]) < 1e-2
        if beta:  # (beta: sigmoid, doubled or not)
            top = 2.0 if beta[2] else 1.0
            part = got[0, beta[0]: beta[0] + beta[1]].float()
            assert bool(((part >= 0) & (part <= top)).all()), part
    op_state = state.clone()
    assert torch.equal(int4_in_proj_conv(x, packed, scale, norm, 1e-6, 1.0, op_state, conv_w),
                       int4_fused_ref(x, packed, scale, "rms", norm, None, None, 1e-6, 1.0,
                                      state.clone(), conv_w))
    print("conv ok", dtype)
# the ops have fake kernels: a compiled function traces through them with no graph break
packed, scale = quantize_packed(torch.randn(40, 64), 64)
x, norm = torch.randn(1, 64), torch.ones(64)
traced = torch.compile(lambda x: int4_fused_linear(x, packed, scale, "rms", norm, None, None,
                                                   1e-6, 0.0) * 2
                       + int4_gemv.int4_matvec(int4_gemv.prepare_x(x), packed, scale,
                                               torch.float32),
                       fullgraph=True, backend="eager")
want = 2 * int4_fused_ref(x, packed, scale, "rms", norm) + int4_gemv.int4_matvec_ref(
    int4_gemv.prepare_x(x), packed, scale, torch.float32)
print("compiled", float((traced(x) - want).abs().max()))
"""


def test_int4_kernels_match_their_twins_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("gemv ok") == 2 and out.count("fused ok") == 4, out
    assert out.count("conv ok") == 2 and "compiled 0.0" in out, out


def test_fused_int4_draft_steps_equal_the_unfused_one(pure_or_hybrid, monkeypatch):
    """The fused view of the int4 draft computes the unfused view's logits step after step
    (the ops run their twins here), with the fused ops really taken: four a block, the GDN
    in-projections with the convolution folded in (FUSE_INT4 on, the default); and FUSE_INT4
    off leaves its blocks plain."""
    model = pure_or_hybrid
    assert fused_draft.FUSE_INT4  # the default (measured faster: fused_draft's comment)
    draft = quantize_view(model, "int4")
    assert any(isinstance(m, Int4Linear) for m in draft.modules())
    fused, plain = gemv_view(draft, fuse=True), gemv_view(draft, fuse=False)
    assert all(block.fused for block in fused.layers)
    calls = []
    monkeypatch.setattr(fused_draft, "int4_fused_linear",
                        spied(fused_draft.int4_fused_linear, "fused", calls))
    monkeypatch.setattr(fused_draft, "int4_in_proj_conv",
                        spied(fused_draft.int4_in_proj_conv, "conv", calls))
    tokens = torch.randint(0, model.config.vocab_size, (1, 8),
                           generator=torch.Generator().manual_seed(1))
    got, expected = steps(fused, tokens), steps(plain, tokens)
    assert len(calls) == tokens.shape[1] * 4 * model.config.num_hidden_layers
    gdn = sum(hasattr(block.mixer, "decode_core") for block in model.layers)
    assert calls.count("conv") == tokens.shape[1] * gdn
    for a, b in zip(got, expected, strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5
    monkeypatch.setattr(fused_draft, "FUSE_INT4", False)
    assert not any(block.fused for block in gemv_view(draft).layers)
