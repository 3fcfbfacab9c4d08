"""The int4 draft's kernels (ops.int4_gemv, ops.int4_fused) against their twins in Triton's
interpreter (the PTX dequantizer swapped for integer arithmetic there: its values are checked
on the GPU, tests/gpu/test_gpu_int4.py), and the fused int4 draft view (unimax.fused_draft)
against the unfused one on the CPU, where the ops run their twins."""

import torch
from test_fused_draft import steps

import unimax.fused_draft as fused_draft
from helpers import kernels_for_test, run_with_triton, spied
from unimax import kernels
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
    in-projections with the convolution folded in (fuse_int4 on, the default); and fuse_int4
    off leaves its blocks plain."""
    model = pure_or_hybrid
    assert kernels.active().fuse_int4  # the default (measured faster: fused_draft's comment)
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
    kernels_for_test(monkeypatch, fuse_int4=False)
    assert not any(block.fused for block in gemv_view(draft).layers)


# The int4 draft's kernels compiled to PTX in a child process, no GPU needed: sm_90 (H200)
# with and without programmatic dependent launch, sm_89 (the L4, which the product demos on
# and this project has no card of) without it, as ops.pdl.pdl_launch asks there.
PTX_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimax.ops.fused_gemv import PROLOGUES
from unimax.ops.int4_gemv_kernels import (int4_epilogue_kernel, int4_gemv_kernel,
                                          int4_ready_kernel)

def ptx(kernel, sig, consts, arch):
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", arch, 32)).asm["ptx"]

def counts(code):
    return (code.count("prmt.b32"), code.count("fma.rn.f16x2"),
            code.count("griddepcontrol.launch_dependents"), code.count("griddepcontrol.wait"))

ready_sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "nw_ptr": "*bf16", "ready_ptr": "*fp16",
             "K": "i32", "eps": "fp32", "offset": "fp32", "PRO": "constexpr",
             "HEAD": "constexpr", "KP": "constexpr", "PRE_BLOCK": "constexpr",
             "PDL": "constexpr"}
gemm_sig = {"ready_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "r_ptr": "*bf16",
            "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32",
            "cs_ptr": "*bf16", "cw_ptr": "*bf16", "C": "i32", "stride_csm": "i32", "B0": "i32",
            "NB": "i32", "HAS_RES": "constexpr", "GROUP": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "CONV_W": "constexpr", "CONV_WP": "constexpr",
            "BETA": "constexpr", "PTX": "constexpr", "PDL": "constexpr",
            "PDL_LATE": "constexpr"}
plain_sig = {"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "y_ptr": "*bf16",
             "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32",
             "GROUP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
             "PRE_X": "constexpr", "PTX": "constexpr"}
for arch, pdls in ((90, ((False, False), (True, False), (True, True))), (89, ((False, False),))):
    for pdl, late in pdls:
        for pro in range(len(PROLOGUES)) if not late else ():  # (it signals at its start)
            code = ptx(int4_ready_kernel, ready_sig,
                       {"PRO": pro, "HEAD": 128, "KP": 4096 if pro == 1 else 1,
                        "PRE_BLOCK": 1024, "PDL": pdl}, arch)
            print("ready", arch, int(pdl), int(late), pro, *counts(code))
        # the in-projection's epilogue (convolution and beta) and the residual one
        for conv, beta, res in ((4, 1, False), (0, 0, True)):
            code = ptx(int4_epilogue_kernel, gemm_sig,
                       {"HAS_RES": res, "GROUP": 128, "BLOCK_N": 16, "BLOCK_K": 512,
                        "CONV_W": conv, "CONV_WP": max(conv, 1), "BETA": beta, "PTX": True,
                        "PDL": pdl, "PDL_LATE": late}, arch)
            print("gemv", arch, int(pdl), int(late), conv, *counts(code))
    code = ptx(int4_gemv_kernel, plain_sig, {"GROUP": 128, "BLOCK_N": 16, "BLOCK_K": 512,
                                             "PRE_X": True, "PTX": True}, arch)
    print("plain", arch, 0, 0, 0, *counts(code))
"""


def test_int4_kernels_compile_for_hopper_and_ada():
    """The int4 draft's three kernels compile for the H200 (sm_90) and the L4 (sm_89) without
    a GPU (the interpreter tests swap the PTX dequantizer out, and only sm_90 is ever run
    here): the GEMVs with the dequantizer's PRMTs and packed FP16 FMAs, the ready kernel with
    every prologue; PDL's launch signal and wait exactly where asked (once each in each
    kernel under PDL, none on sm_89 or without it), so an L4 never meets an sm_90 instruction."""
    out = run_with_triton(PTX_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    ready = [[int(v) for v in row[1:]] for row in rows if row[0] == "ready"]
    gemv = [[int(v) for v in row[1:]] for row in rows if row[0] == "gemv"]
    plain = [[int(v) for v in row[1:]] for row in rows if row[0] == "plain"]
    assert len(ready) == 3 * 6 and len(gemv) == 4 * 2 and len(plain) == 2, out
    for arch, pdl, late, _, _, _, signal, wait in ready:
        assert (signal, wait) == ((1, 1) if pdl else (0, 0)), (arch, pdl, late, out)
    for arch, pdl, late, _, prmt, hfma2, signal, wait in gemv + plain:
        assert prmt > 0 and hfma2 > 0, (arch, pdl, out)
        assert (signal, wait) == ((1, 1) if pdl else (0, 0)), (arch, pdl, late, out)
    assert {row[0] for row in ready + gemv if row[1]} == {90}, out
