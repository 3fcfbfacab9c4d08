"""The draft's MLP as one launch (unimax.ops.fused_mlp): its kernel in Triton's interpreter (a
child process) against the pair of fused GEMVs it replaces and against its twin; compiled for
sm_90 / sm_89; the op's bad input; which views take it (verified mode's full draft only)."""

import pytest
import torch

from helpers import run_with_triton
from unimax import GDNForCausalLM, build_engine
from unimax.ops import fused_mlp
from unimax.tiny import TINY_CONFIG

CHILD = """
import torch
from unimax.fp8 import quantize_rows
from unimax.ops.fused_gemv import fused_gemv
from unimax.ops.fused_mlp import _ROWS, TILES, fused_mlp, fused_mlp_ref

def pad(t, rows, cols):
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[:t.shape[0], :t.shape[1]] = t
    return out

torch.manual_seed(0)
for hidden, inter, padded in [(96, 40, False), (300, 70, True), (520, 33, True), (64, 16, False)]:
    gu, gs = quantize_rows(torch.randn(2 * inter, hidden))
    dw, ds = quantize_rows(torch.randn(hidden, inter))
    if padded:  # (an FP8Linear's weights are padded past their logical shape)
        gu, gs = pad(gu, 2 * inter + 5, hidden + 16), torch.cat([gs, torch.ones(5)])
        dw, ds = pad(dw, hidden + 3, inter + 16), torch.cat([ds, torch.ones(3)])
    nw = (torch.randn(hidden) * 0.1).to(torch.bfloat16)
    for trial, tile in enumerate(TILES):  # (each launch finds the row and counter zeroed)
        x = (torch.randn(1, hidden) * 3).to(torch.bfloat16)
        got = fused_mlp(x, gu, gs, dw, ds, hidden, inter, nw, 1e-6, 1.0, tile)
        gate_up = fused_gemv(x, gu, gs, 2 * inter, hidden, "rms", norm_weight=nw, eps=1e-6,
                             offset=1.0, kernel="rows")
        pair = fused_gemv(gate_up, dw, ds, hidden, inter, "swiglu", residual=x, kernel="rows")
        twin = fused_mlp_ref(x, gu, gs, dw, ds, hidden, inter, nw, 1e-6, 1.0)
        again = fused_mlp(x, gu, gs, dw, ds, hidden, inter, nw, 1e-6, 1.0, tile)
        mlp = (twin.float() - x.float()).norm()
        err_twin = float((got.float() - twin.float()).norm() / mlp)
        err_pair = float((got.float() - pair.float()).norm() / mlp)
        same_op = bool(torch.equal(again, got))  # (a second launch, on the zeroed row)
        zeroed = all(float(r.abs().sum()) == 0 and int(c) == 0 for r, c in _ROWS.values())
        print(f"{hidden}x{inter}x{trial} {err_twin:.2e} {err_pair:.2e} {int(same_op)} "
              f"{int(zeroed)}")
"""


def test_fused_mlp_matches_the_gemv_pair_and_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 4 * 4, out
    for tag, err_twin, err_pair, same_op, zeroed in rows:
        # against the pair of kernels it replaces (the interpreter truncates both alike): the
        # down-projection's fp32 sums in another order only
        assert float(err_pair) < 1e-2, (tag, out)
        # against the twin (rounded to nearest, where the interpreter truncates): BF16's step
        assert float(err_twin) < 3e-2, (tag, out)
        assert same_op == "1" and zeroed == "1", (tag, out)


def test_fused_mlp_kernel_compiles_for_hopper_and_ada():
    """The kernel lowers to PTX for sm_90 (the H200; plain, and PDL signalled at the start or
    after the atomics) and sm_89 (an L4, no PDL) at a 0.8B-like shape."""
    code = """
import torch, triton
from triton.backends.compiler import GPUTarget
from unimax.ops import fused_mlp
from unimax.ops.fused_mlp_kernel import fused_mlp_kernel
sig = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "gu_ptr": "*fp8e4nv", "gus_ptr": "*fp32",
       "d_ptr": "*fp8e4nv", "ds_ptr": "*fp32", "y_ptr": "*bf16", "acc_ptr": "*fp32",
       "cnt_ptr": "*i32", "H": "i32", "I": "i32", "stride_gu": "i32", "stride_d": "i32",
       "eps": "fp32", "offset": "fp32", "HP": "constexpr", "BLOCK_R": "constexpr",
       "BLOCK_K": "constexpr", "BLOCK_H": "constexpr", "PDL": "constexpr",
       "PDL_LATE": "constexpr"}
for arch, pdl, late in ((90, False, False), (90, True, False), (90, True, True),
                        (89, False, False)):
    units, block_k, block_h, _ = fused_mlp.TILES[0]
    consts = {"HP": 1024, "BLOCK_R": units, "BLOCK_K": block_k, "BLOCK_H": block_h,
              "PDL": pdl, "PDL_LATE": late}
    src = triton.compiler.ASTSource(fn=fused_mlp_kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 64)).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    # the atomics; with PDL the wait and the signal, the signal after the adds when late
    print(arch, int("red." in body or "atom." in body), int("griddepcontrol.wait" in body),
          int(body.index("griddepcontrol.launch_dependents") >
              body.index("red.") if "griddepcontrol.launch_dependents" in body else -1))
"""
    out = run_with_triton(code, interpret=False)
    assert out.strip().splitlines() == ["90 1 0 -1", "90 1 1 0", "90 1 1 1", "89 1 0 -1"], out


def test_the_op_off_cuda_is_its_twin_and_names_its_choices():
    """Off CUDA the op runs the twin; its choices are the pair and the kernel at each tile,
    and a bad name is refused by name."""
    torch.manual_seed(0)
    from unimax.fp8 import quantize_rows

    h, i = 64, 24
    gu, gs = quantize_rows(torch.randn(2 * i, h))
    dw, ds = quantize_rows(torch.randn(h, i))
    nw, x = torch.randn(h).bfloat16(), torch.randn(1, h).bfloat16()
    twin = fused_mlp.fused_mlp_ref(x, gu, gs, dw, ds, h, i, nw, 1e-6, 0.0)
    assert torch.equal(fused_mlp.fused_mlp_step(x, gu, gs, dw, ds, h, i, nw, 1e-6, 0.0), twin)
    assert torch.equal(fused_mlp.run_named("pair", x, gu, gs, dw, ds, h, i, nw, 1e-6, 0.0),
                       twin)
    names = fused_mlp.names()
    assert names[0] == "pair" and len(names) == 1 + len(fused_mlp.TILES)
    with pytest.raises(ValueError, match="pair"):
        fused_mlp.run_named("one@1x2x3x4", x, gu, gs, dw, ds, h, i, nw, 1e-6, 0.0)
    with pytest.raises(ValueError, match="tile"):
        fused_mlp.fused_mlp(x, gu, gs, dw, ds, h, i, nw, 1e-6, 0.0, (1, 2, 3, 4))


def test_fused_mlp_names_bad_input():
    h, i = 64, 16
    gu, gs = torch.zeros(2 * i, h, dtype=torch.float8_e4m3fn), torch.ones(2 * i)
    dw, ds = torch.zeros(h, i, dtype=torch.float8_e4m3fn), torch.ones(h)
    nw = torch.ones(h, dtype=torch.bfloat16)
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row of 64"):
        fused_mlp.fused_mlp(x, gu, gs, dw, ds, h, i, nw, 1e-6)
    with pytest.raises(ValueError, match="gate_up weight"):
        fused_mlp.fused_mlp(x[:1], gu[:20], gs, dw, ds, h, i, nw, 1e-6)
    with pytest.raises(ValueError, match="down weight"):
        fused_mlp.fused_mlp(x[:1], gu, gs, dw[:, :8], ds, h, i, nw, 1e-6)
    with pytest.raises(ValueError, match="per-row scales"):
        fused_mlp.fused_mlp(x[:1], gu, None, dw, ds, h, i, nw, 1e-6)


def test_only_verified_modes_full_draft_is_marked(monkeypatch):
    """With FUSED_MLP on, a full FP8 draft's fused blocks are marked; the FP8 tail (speed
    mode, whose tokens are its output) and BF16-only never: the op's sums are not
    reproducible bit for bit. (build_engine's views are made only with the fast step; the
    marking itself is checked on a view.)"""
    from unimax.fast_step import gemv_view
    from unimax.fp8 import quantize_view

    model = GDNForCausalLM.random(TINY_CONFIG, seed=0)
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", True)
    full = gemv_view(quantize_view(model, "full", mode="emulated"))
    assert fused_mlp.mark_view(full) == TINY_CONFIG.num_hidden_layers
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", False)
    assert fused_mlp.mark_view(full) == 0
    assert not any(block.mlp_one_launch for block in full.layers)
    # on the CPU the engine has no fast step, so nothing is marked and decoding is as before
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", True)
    engine = build_engine(model, decode="fp8", draft="full")
    assert not any(getattr(b, "mlp_one_launch", False) for b in engine.decode_model.layers)
