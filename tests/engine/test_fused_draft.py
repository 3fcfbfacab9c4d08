"""The draft's fused GEMVs (unimax.ops.fused_gemv: a norm, gated norm or SwiGLU folded into how
the GEMV reads x, the residual add into its store) against their twin, the torch forms, in
Triton's interpreter; the fused draft view (unimax.fused_draft) against the unfused one, pure
and hybrid, on the CPU (where the op runs the twin); the exact model never fused."""

import pytest
import torch

import unimax.fused_draft as fused_draft
from helpers import kernels_for_test, run_with_triton, spied, verifier_recordings
from unimax import kernels
from unimax.fast_step import gemv_view
from unimax.fp8 import quantize_view
from unimax.ops.fused_gemv import PROLOGUES, fused_small_m_linear

CASES = """
import torch
from unimax.fp8 import quantize_rows
from unimax.ops.fused_gemv import fused_gemv, fused_small_m_linear, fused_small_m_linear_ref
def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())
def cases(dtype, m, n, k, head):
    \"\"\"Every prologue's inputs, with and without the residual, and the weights: FP8 with
    scales and plain, padded past (n, k) as an FP8Linear's weight is.\"\"\"
    w = torch.randn(n + 5, k + 16)
    q, s = quantize_rows(w)
    for prologue in ("none", "rms", "gated_silu", "gated_sigmoid", "swiglu", "sigmoid_gate"):
        gated = prologue.startswith("gated")
        x = (3 * torch.randn(m, 2 * k if prologue == "swiglu" else k)).to(dtype)
        z = torch.randn(m, k).to(dtype) if gated or prologue == "sigmoid_gate" else None
        norm = (1 + 0.1 * torch.randn(head if gated else k)
                if prologue in ("rms", "gated_silu", "gated_sigmoid") else None)
        offset = 1.0 if prologue == "rms" else 0.0
        for res in (None, torch.randn(m, n).to(dtype)):
            for weight, scale in ((q, s), (w.to(dtype), None)):
                ref = fused_small_m_linear_ref(x, weight, scale, n, k, prologue, norm, z, res,
                                               1e-6, offset)
                yield prologue, (x, weight, scale, n, k, prologue, norm, z, res, 1e-6,
                                 offset), ref
"""

# One child a dtype, and the rest (tiles, TMA, conv) in a third: all of it in one
# child took 466 s of the 600 s that run_with_triton gives a child (a CI run, 2
# cores), 23% of the suite.
LOOP_CHILD = CASES + """
torch.manual_seed(0)
dtype = getattr(torch, DTYPE)
for m, n, k, head in [(1, 100, 128, 32), (2, 70, 256, 64), (1, 33, 192, 64), (3, 40, 64, 16)]:
    for prologue, args, ref in cases(dtype, m, n, k, head):
        fp16 = ("rows16", "split16") if args[2] is not None else ()
        for kernel in ("rows", "split") + fp16:  # (split-K: slices of K, some empty)
            y = fused_gemv(*args, kernel=kernel)
            err = rel(y, ref)
            exact = dtype == torch.float32 and kernel in ("rows", "split")
            assert y.shape == ref.shape == (m, n) and y.dtype == dtype
            assert err < (1e-5 if exact else 2e-2), (dtype, m, n, k, prologue,
                                                      args[8] is None, kernel, err)
    print("ok", dtype, m, n, k)
"""

CHILD = CASES + """
torch.manual_seed(0)
# each form at a tile given by hand (the timed choice's names): the first and the last
from unimax.ops.fused_gemv import tiles_for
from unimax.ops.gemv import tile_text
for prologue, args, ref in cases(torch.bfloat16, 1, 70, 256, 64):
    if args[8] is None:  # (with the residual only: the interpreter is slow)
        continue
    for tile in (tiles_for(64)[0], tiles_for(64)[-1]):
        fp16 = ("rows16", "split16") if args[2] is not None else ()
        for form in ("rows", "split") + fp16:
            y = fused_gemv(*args, kernel=f"{form}@{tile_text(tile)}")
            assert rel(y, ref) < 2e-2, (prologue, form, tile)
print("tiles fine")
# the TMA forms (W's tiles through a tensor descriptor over (n, k), zeros past both: the
# weights are padded with random values past n and k, and K = 192 leaves a tile part empty),
# each at its first and last tile, with and without the residual at the narrower tiles
from unimax.ops.fused_gemv import TMA_FORMS, _tiles_by_form
for m, n, k in ((1, 70, 256), (2, 33, 192)):
    for prologue, args, ref in cases(torch.bfloat16, m, n, k, 64):
        tiles = _tiles_by_form(64)["tma"]
        for tile in (tiles[0], tiles[-1]) if args[8] is not None else tiles[:1]:
            for form in TMA_FORMS if args[2] is not None else ("tma",):
                y = fused_gemv(*args, kernel=f"{form}@{tile_text(tile)}")
                assert rel(y, ref) < 2e-2, (m, n, k, prologue, form, tile, rel(y, ref))
print("tma fine")
# the in-projection with the convolution folded in (ops.in_proj_conv): its first C outputs
# through the causal conv and SiLU, the window rolled in the state, against the twin
from unimax.ops.in_proj_conv import fused_in_proj_conv_ref
for dtype in (torch.float32, torch.bfloat16):
    w = torch.randn(105, 272)
    q, s = quantize_rows(w)
    x = (3 * torch.randn(1, 256)).to(dtype)
    norm = 1 + 0.1 * torch.randn(256)
    conv_w = torch.randn(64, 4)
    state = torch.randn(1, 64, 4).to(dtype)
    for kernel, weight, scale in (("rows", q, s), ("rows16@16x256x4", q, s), ("split", q, s),
                                  ("tma@16x256x4x4", w.to(dtype), None), ("tma16", q, s)):
        got_state, want_state = state.clone(), state.clone()
        got = fused_gemv(x, weight, scale, 100, 256, "rms", norm, eps=1e-6, offset=1.0,
                         kernel=kernel, conv_state=got_state, conv_weight=conv_w)
        want = fused_in_proj_conv_ref(x, weight, scale, 100, 256, norm, 1e-6, 1.0, want_state,
                                      conv_w)
        exact = dtype == torch.float32 and "16" not in kernel
        assert rel(got, want) < (1e-5 if exact else 2e-2), (dtype, kernel, rel(got, want))
        assert torch.equal(got_state[..., :3], state[..., 1:]), kernel  # (the window rolled)
        assert rel(got_state[..., 3], want_state[..., 3]) < (1e-5 if exact else 2e-2)
print("conv fine")
from unimax.ops.fused_gemv import _counters
print("counters left", int(_counters(torch.device("cpu")).abs().sum()))  # all set back to 0
# RMS over a row longer than 8192: the norm's pre-pass loops over slices there
x, norm, w = torch.randn(1, 8200), 1 + 0.1 * torch.randn(8200), torch.randn(8, 8200)
ref = fused_small_m_linear_ref(x, w, None, 8, 8200, "rms", norm, None, None, 1e-6, 0.0)
assert rel(fused_gemv(x, w, None, 8, 8200, "rms", norm, None, None, 1e-6, 0.0), ref) < 1e-5
print("ok long row")
# the op has a fake kernel: a compiled function traces through it with no graph break
x, norm = torch.randn(1, 64), torch.ones(64)
q, s = quantize_rows(torch.randn(40, 64))
traced = torch.compile(lambda x: fused_small_m_linear(x, q, s, 40, 64, "rms", norm, None, None,
                                                      1e-6, 0.0) * 2,
                       fullgraph=True, backend="eager")
print("compiled", float((traced(x) - 2 * fused_small_m_linear_ref(
    x, q, s, 40, 64, "rms", norm, None, None, 1e-6, 0.0)).abs().max()))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_gemv_matches_its_twin_in_the_interpreter(dtype):
    out = run_with_triton(LOOP_CHILD.replace("DTYPE", repr(dtype)))
    assert out.count(f"ok torch.{dtype}") == 4, out


def test_fused_gemv_tiles_tma_and_conv_match_the_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("ok") == 1 and "compiled 0.0" in out and "counters left 0" in out, out
    assert "tiles fine" in out and "tma fine" in out and "conv fine" in out, out
    assert "ok long row" in out, out


def test_tma_forms_are_offered_where_they_fit():
    """The per-shape choice's candidates: the TMA forms only where asked (the device and W's
    layout allow: ``tma_problem``), "tma16" and the split ones for FP8 weights only (the split
    ones where split-K is offered), each tile's BLOCK_K at least one head and at most a TMA
    box; rows, rows16 and split-K as before. ``tma_problem`` names a pre-Hopper device and a
    misaligned W, and fused_gemv refuses a TMA form there."""
    from unimax.ops.fused_gemv import (
        TMA_FORMS,
        TMA_MAX_K,
        TMA_OFFERED,
        TMA_TILES,
        candidates,
        fused_gemv,
        tma_problem,
    )
    from unimax.ops.gemv import tile_text

    def forms(names):
        return {n.split("@")[0] for n in names}

    fp8 = candidates(2560, 4096, 1, True, 128, tma=True)  # (a 4B out-projection)
    assert forms(fp8) == {"rows", "rows16", "split", "split16", *TMA_FORMS}
    assert forms(candidates(2560, 4096, 1, True, 128)) == {"rows", "rows16", "split", "split16"}
    assert forms(candidates(12352, 2560, 1, False, 1, tma=True)) == {"rows", "tma"}
    # (the TMA split forms where split-K is offered: FP8, narrow outputs, K-long)
    assert forms(candidates(12352, 2560, 1, True, 1, tma=True)) == {"rows", "rows16", "tma",
                                                                     "tma16"}
    assert forms(candidates(64, 256, 1, True, 1, tma=True)) == {"rows", "rows16"}  # (short K)
    for name in fp8:
        if name.startswith("tma"):
            n, k, warps, stages = (int(v) for v in name.split("@")[1].split("x"))
            assert 128 <= k <= TMA_MAX_K and stages > 1, name
    # each TMA form at the offered tile only (each tile a compile at warm-up); the others
    # stay nameable (benches)
    tma = [name for name in fp8 if name.startswith("tma")]
    assert len(tma) == len(TMA_FORMS) * len(TMA_OFFERED) and len(TMA_TILES) > len(TMA_OFFERED)
    assert {name.split("@")[1] for name in tma} == {tile_text(t) for t in TMA_OFFERED}
    from unimax.ops.fused_gemv import _tiles_by_form
    from unimax.ops.gemv import parse_kernel

    for tile in TMA_TILES:
        assert parse_kernel(f"tmasplit16@{tile_text(tile)}", _tiles_by_form(1), "t")[1] == tile
    x, w = torch.randn(1, 64), torch.randn(40, 64)
    assert "compute capability 9.0" in tma_problem(w, x)  # (no Triton interpreter here)
    with pytest.raises(ValueError, match="tma: TMA needs compute capability"):
        fused_gemv(x, w, None, 40, 64, "none", kernel="tma")
    assert forms(candidates(12352, 2560, 1, False, 1, tma=True)) == {"rows", "tma"}


TMA_ALIGN_CHILD = """
import torch
import unimax.ops.fused_gemv as f
from unimax.ops.fused_gemv import fused_gemv, tma_offered, tma_problem
x, w = torch.randn(1, 64), torch.randn(40, 72)
print("aligned", tma_problem(w, x))
print("offered", tma_offered(w, x), tma_offered(w[:, 1:65], x))
from unimax import kernels
with kernels.using(kernels.DEFAULT.but(tma=False)):
    print("off", tma_offered(w, x))
print("offset", tma_problem(w[:, 1:65], x))
print("stride", tma_problem(torch.randn(40, 67)[:, :64], x))
try:
    fused_gemv(x, w[:, 1:65], None, 40, 64, "none", kernel="tma")
except ValueError as e:
    print("refused", e)
"""


def test_tma_problem_names_a_misaligned_weight():
    """tma_problem names a misaligned W (base or rows); the choice is offered the TMA forms only
    where there is no problem and the kernel configuration's ``tma`` is on; fused_gemv refuses
    them elsewhere."""
    out = run_with_triton(TMA_ALIGN_CHILD)
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["aligned"] == "None", out
    assert lines["offered"] == "True False" and lines["off"] == "False", out
    assert "16-byte aligned" in lines["offset"] and "16-byte aligned" in lines["stride"], out
    assert "take a rows form" in lines["refused"], out


def spy_fused(monkeypatch, calls: list) -> None:
    """Record in ``calls`` each fused GEMV a fused block runs: "fused", or "conv" for a GDN
    in-projection with the convolution folded in (ops.in_proj_conv)."""
    monkeypatch.setattr(fused_draft, "fused_small_m_linear",
                        spied(fused_small_m_linear, "fused", calls))
    monkeypatch.setattr(fused_draft, "fused_in_proj_conv",
                        spied(fused_draft.fused_in_proj_conv, "conv", calls))


def steps(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Logits of one-token decode steps over ``tokens`` on a fresh cache (as the decoder runs
    them: inference mode)."""
    cache = model.make_recurrent_cache()
    out = []
    with torch.inference_mode():
        for i in range(tokens.shape[1]):
            out.append(model(input_ids=tokens[:, i: i + 1], past_key_values=cache,
                             use_cache=True).logits)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_draft_steps_equal_the_unfused_draft(pure_or_hybrid, dtype, monkeypatch):
    """The fused view of a full-FP8 draft computes the unfused view's logits step after step
    (here the op runs its twin, the torch forms: up to the matmuls' summation order, since
    the twin reads the FP8 weight unpadded, and in BF16 the gates' sigmoid, which the fused
    step leaves unrounded), with the fused op really taken: four GEMVs per block, GDN and
    attention alike, a GDN block's in-projection with the convolution folded in
    (ops.in_proj_conv)."""
    model = pure_or_hybrid.to(dtype)
    try:
        draft = quantize_view(model, "full")
        fused, plain = gemv_view(draft, fuse=True), gemv_view(draft, fuse=False)
        tokens = torch.randint(0, model.config.vocab_size, (1, 12),
                               generator=torch.Generator().manual_seed(1))
        calls = []
        spy_fused(monkeypatch, calls)
        got, expected = steps(fused, tokens), steps(plain, tokens)
        assert len(calls) == tokens.shape[1] * 4 * model.config.num_hidden_layers
        gdn = sum(hasattr(block.mixer, "decode_core") for block in model.layers)
        assert calls.count("conv") == tokens.shape[1] * gdn  # (the GDN in-projections)
        tol = 1e-5 if dtype == torch.float32 else 5e-2  # (bf16: beta unrounded, 12 steps)
        for a, b in zip(got, expected, strict=True):
            assert float((a.float() - b.float()).norm() / b.float().norm()) < tol
        if dtype == torch.float32:
            assert torch.equal(torch.cat(got).argmax(-1), torch.cat(expected).argmax(-1))
    finally:
        pure_or_hybrid.float()


def test_bf16_step_fused_by_default(pure_or_hybrid, monkeypatch):
    """The BF16 fast step's view (the kernel configuration's fuse_bf16, on) marks its GEMVs and
    blocks, on the view only; its steps compute the unfused view's logits. With fuse_bf16 off
    it marks nothing."""
    model = pure_or_hybrid
    fused = gemv_view(model)
    assert all(b.fused for b in fused.layers)
    assert not any(getattr(m, "fused", False) for m in model.modules())
    plain = gemv_view(model, fuse=False)
    assert not any(getattr(m, "fused", False) for m in plain.modules())
    calls = []
    spy_fused(monkeypatch, calls)
    tokens = torch.randint(0, model.config.vocab_size, (1, 6),
                           generator=torch.Generator().manual_seed(2))
    for a, b in zip(steps(fused, tokens), steps(plain, tokens), strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5
    assert len(calls) == 6 * 4 * model.config.num_hidden_layers
    kernels_for_test(monkeypatch, fuse_bf16=False)
    assert not any(getattr(m, "fused", False) for m in gemv_view(model).modules())


def test_only_fp8_blocks_are_fused_and_grad_mode_takes_the_plain_forms(pure_or_hybrid,
                                                                      monkeypatch):
    """Without fuse_bf16, fuse_blocks marks only blocks with FP8 linears: none of the BF16
    step's, the FP8 tail's last block only; the model itself is untouched by a draft view. In
    default grad mode (the op has no backward) a fused view takes the plain forms, with the
    same numbers."""
    model = pure_or_hybrid
    last = model.config.num_hidden_layers - 1
    kernels_for_test(monkeypatch, fuse_bf16=False)
    assert fused_draft.fuse_blocks(gemv_view(model)) == 0  # (bf16=False: FP8 linears only)
    tail = gemv_view(quantize_view(model, "tail"))
    assert [b.fused for b in tail.layers] == [i == last for i in range(last + 1)]
    full = gemv_view(quantize_view(model, "full"))
    assert all(b.fused for b in full.layers)
    assert not any(b.fused for b in model.layers)
    calls = []
    spy_fused(monkeypatch, calls)
    token = torch.tensor([[5]])
    assert torch.is_grad_enabled()
    logits = full(input_ids=token, past_key_values=full.make_recurrent_cache(),
                  use_cache=True).logits
    assert calls == []
    with torch.inference_mode():
        fused = full(input_ids=token, past_key_values=full.make_recurrent_cache(),
                     use_cache=True).logits
    assert calls and torch.allclose(logits, fused, rtol=1e-5, atol=1e-6)


def test_fused_op_names_bad_input():
    x, w = torch.randn(1, 64), torch.randn(40, 64)
    with pytest.raises(ValueError, match="prologue must be one of"):
        fused_small_m_linear(x, w, None, 40, 64, "layernorm", None, None, None, 1e-6, 0.0)
    with pytest.raises(ValueError, match="needs the norm's weight"):
        fused_small_m_linear(x, w, None, 40, 64, "rms", None, None, None, 1e-6, 0.0)
    with pytest.raises(ValueError, match="head size 24 must be a power of 2"):
        fused_small_m_linear(x, w, None, 40, 64, "gated_silu", torch.ones(24), x, None, 1e-6,
                             0.0)
    with pytest.raises(ValueError, match="sigmoid_gate prologue: z must have x's shape"):
        fused_small_m_linear(x, w, None, 40, 64, "sigmoid_gate", None, None, None, 1e-6, 0.0)
    with pytest.raises(ValueError, match=r"x must be \(M, 128\)"):
        fused_small_m_linear(x, w, None, 40, 64, "swiglu", None, None, None, 1e-6, 0.0)
    with pytest.raises(ValueError, match=r"residual must be \(1, 40\)"):
        fused_small_m_linear(x, w, None, 40, 64, "none", None, None, torch.randn(1, 39), 1e-6,
                             0.0)
    assert set(PROLOGUES) == {"none", "rms", "gated_silu", "gated_sigmoid", "swiglu",
                              "sigmoid_gate"}
    # the in-projection with the convolution folded in: its state and weight by name
    conv_in = fused_draft.fused_in_proj_conv
    norm = torch.ones(64)
    with pytest.raises(ValueError, match=r"conv_state \(1, 32, 3\) must be \(1, >= 32, 4\)"):
        conv_in(x, w, None, 40, 64, norm, 1e-6, 0.0, torch.zeros(1, 32, 3), torch.ones(32, 4))
    with pytest.raises(ValueError, match="channels at most 40"):
        conv_in(x, w, None, 40, 64, norm, 1e-6, 0.0, torch.zeros(1, 48, 4), torch.ones(48, 4))
    with pytest.raises(ValueError, match="conv_weight must be a contiguous"):
        conv_in(x, w, None, 40, 64, norm, 1e-6, 0.0, torch.zeros(1, 32, 4),
                torch.ones(4, 32).t())


# The fused GEMV kernel and its signature, compiled to PTX in a child process (no GPU)
FUSED_KERNEL = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import unimax.ops.fused_gemv as f

fn = f._kernel(True, 128)[1].fn
sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*fp8e4nv",
       "s_ptr": "*fp32", "r_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "N": "i32", "K": "i32",
       "stride_xm": "i32", "stride_zm": "i32", "stride_wn": "i32", "stride_rm": "i32",
       "stride_ym": "i32", "eps": "fp32", "offset": "fp32", "cs_ptr": "*bf16", "cw_ptr": "*bf16",
       "C": "i32", "stride_csm": "i32", "B0": "i32", "NB": "i32", "PRO": "constexpr",
       "HEAD": "constexpr", "KP": "constexpr", "HAS_SCALE": "constexpr", "HAS_RES": "constexpr",
       "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "F16": "constexpr", "PDL": "constexpr",
       "SPLIT": "constexpr", "PDL_LATE": "constexpr", "CONV_W": "constexpr",
       "CONV_WP": "constexpr", "TMA": "constexpr", "STAGES": "constexpr", "BETA": "constexpr"}

def compiled(consts, arch=90, signature=sig):
    consts = {"CONV_W": 0, "CONV_WP": 1, "TMA": False, "STAGES": 1, "BETA": 0, **consts}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                          target=GPUTarget("cuda", arch, 32)).asm

def ptx(consts, arch=90):
    return compiled(consts, arch)["ptx"]
"""

PTX_CHILD = FUSED_KERNEL + """
for arch in (90, 89):  # H100/H200, L4
    for pro in range(len(f.PROLOGUES)):
        for f16 in (True, False):
            consts = {"PRO": pro, "HEAD": 128, "KP": 4096, "HAS_SCALE": True,
                      "HAS_RES": pro % 2 == 0, "BLOCK_N": 16, "BLOCK_K": 256, "F16": f16,
                      "PDL": False, "SPLIT": 4 if pro % 3 == 0 else 1, "PDL_LATE": False}
            code = ptx(consts, arch)
            print(arch, pro, f16, code.count("cvt.rn.f16x2.e4m3x2"), code.count("fma.rn.f16x2"),
                  code.count("atom.global"))
    # the in-projection with the convolution folded in (ops.in_proj_conv): the epilogue
    # compiles, its stores of the rolled windows beside the output's
    consts = {"PRO": 1, "HEAD": 1, "KP": 4096, "HAS_SCALE": True, "HAS_RES": False,
              "BLOCK_N": 16, "BLOCK_K": 256, "F16": True, "PDL": False, "SPLIT": 1,
              "PDL_LATE": False, "CONV_W": 4, "CONV_WP": 4}
    stores = [sum("st.global" in line for line in ptx({**consts, "CONV_W": w}, arch).splitlines())
              for w in (4, 0)]
    # and beta's sigmoid in that epilogue (ops.in_proj_conv's b channels): more exponentials
    # (the conv's SiLU has its own), plain and doubled
    exps = [ptx({**consts, "BETA": beta}, arch).count("ex2.approx") for beta in (0, 1, 2)]
    print("conv", arch, *stores, *exps)
# the TMA form (sm_90): W's tile loads in the K loop are TMA copies, and Triton's pipeliner
# issues them STAGES - 1 ahead (more async copies and shared memory with more stages)
tma_sig = {**sig, "w_ptr": "tensordesc<fp8e4nv[32, 256]>"}
for stages, split in ((1, 1), (4, 1), (4, 4)):
    asm = compiled({"PRO": 1, "HEAD": 1, "KP": 4096, "HAS_SCALE": True, "HAS_RES": False,
                    "BLOCK_N": 32, "BLOCK_K": 256, "F16": True, "PDL": False, "SPLIT": split,
                    "PDL_LATE": False, "TMA": True, "STAGES": stages}, 90, tma_sig)
    print("tma", stages * split, asm["ttgir"].count("async_tma_copy"),
          asm["ptx"].count("cp.async.bulk.tensor"), asm["ptx"].count("atom.global"))
"""


def test_fused_gemv_compiles_for_hopper_and_ada():
    """Every prologue compiles to PTX for the H200 (sm_90) and the L4 (sm_89) without a GPU
    (the interpreter does not compile), converting FP8 pairwise, with packed FP16 products
    in the rows16 form, and the split-K form (atomics) where asked; and the form with the
    convolution folded in, storing the rolled windows; and the TMA form's loop pipelined."""
    out = run_with_triton(PTX_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    conv = [row for row in rows if row[0] == "conv"]
    tma = {int(row[1]): tuple(int(v) for v in row[2:]) for row in rows if row[0] == "tma"}
    rows = [row for row in rows if row[0] not in ("conv", "tma")]
    # one TMA load before the loop and one in it unpipelined; 3 more in flight at 4 stages
    assert tma[1][0] >= 1 and tma[4][0] >= tma[1][0] + 2 and tma[4][1] > tma[1][1], out
    assert tma[16][0] == tma[4][0] and tma[16][2] > 0 == tma[4][2], out  # (split-K: atomics)
    assert len(rows) == 2 * len(PROLOGUES) * 2, out
    assert [row[:2] for row in conv] == [["conv", "90"], ["conv", "89"]], out
    assert all(int(row[2]) > int(row[3]) for row in conv), out  # (the windows' stores)
    assert all(int(row[5]) > int(row[4]) > 0 and int(row[6]) == int(row[5])
               for row in conv), out  # (beta's sigmoid, plain and doubled)
    for arch, pro, f16, cvt, hfma2, atomics in rows:
        assert int(cvt) > 0, (arch, pro, f16)
        assert (int(hfma2) > 0) == (f16 == "True"), (arch, pro, f16, hfma2)
        assert (int(atomics) > 0) == (int(pro) % 3 == 0), (arch, pro, atomics)  # split-K


PDL_CHILD = FUSED_KERNEL + r"""
import re
for pro in (1, 4):  # rms (reads x before the loop), swiglu
    for pdl, late in ((False, False), (True, False), (True, True)):
        consts = {"PRO": pro, "HEAD": 128, "KP": 4096, "HAS_SCALE": True, "HAS_RES": True,
                  "BLOCK_N": 16, "BLOCK_K": 256, "F16": True, "PDL": pdl, "SPLIT": 1,
                  "PDL_LATE": late}
        lines = ptx(consts).splitlines()
        def first(pattern):
            return next((i for i, line in enumerate(lines) if re.search(pattern, line)), -1)
        trigger, wait = first("griddepcontrol.launch_dependents"), first("griddepcontrol.wait")
        load, store = first(r"ld\.global"), first(r"st\.global")
        # start: signal, first weight tile, wait; end: tile, wait, the loop, signal, store
        order = (0 <= load < wait < trigger < store) if late else (0 <= trigger < load < wait)
        print(pro, pdl, late, sum("griddepcontrol" in line for line in lines),
              order if pdl else "-")
"""


def test_fused_gemv_pdl_form_compiles_for_hopper():
    """The fused GEMV's programmatic-dependent-launch form (the kernel configuration's pdl),
    compiled for sm_90 without a GPU: it lets its dependents launch first thing, loads (its first
    weight tile) before it waits for the kernel before, and waits once; with the signal at the end
    (pdl_trigger "end"), the load, the wait, then the signal, before it stores; without PDL, neither
    instruction. (Its sums equal the PDL-free form's on the GPU:
    tests/gpu/test_gpu_engine.py.)"""
    out = run_with_triton(PDL_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert rows == [["1", "False", "False", "0", "-"], ["1", "True", "False", "2", "True"],
                    ["1", "True", "True", "2", "True"],
                    ["4", "False", "False", "0", "-"], ["4", "True", "False", "2", "True"],
                    ["4", "True", "True", "2", "True"]], rows


def test_pdl_is_asked_for_by_weight_dtype(monkeypatch):
    """The kernel configuration's pdl: True asks for programmatic launch of every fused GEMV,
    "fp8" of the FP8 weights' only (the draft's: BF16-only's step and the verifier keep plain
    launches), False of none; anything else, or an unknown trigger, is refused by name when
    the configuration is made. (On a CPU no launch takes it: pdl_launch stays empty.)"""
    from unimax.kernels import KernelConfig
    from unimax.ops import pdl

    fp8 = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    bf16 = torch.zeros(4, 8, dtype=torch.bfloat16)
    for setting, wanted in ((False, (False, False)), (True, (True, True)),
                            ("fp8", (True, False))):
        kernels_for_test(monkeypatch, pdl=setting)
        assert (pdl.pdl_wanted(fp8), pdl.pdl_wanted(bf16)) == wanted, setting
        assert pdl.pdl_launch(bf16, fp8) == {}  # (a CPU tensor: never launched so)
    with pytest.raises(ValueError, match="pdl must be False, True, 'fp8' or 'auto', got 'bf16'"):
        KernelConfig(pdl="bf16")
    with pytest.raises(ValueError, match="pdl_trigger must be 'start', 'end' or 'auto'"):
        KernelConfig(pdl="fp8", pdl_trigger="middle")


@pytest.mark.parametrize("block", [1, 4])
def test_verified_with_the_fused_full_draft_equals_exact_greedy(pure_or_hybrid, block,
                                                               monkeypatch):
    """An engine whose draft is the fused full-FP8 view (what build_engine's compiled draft
    is on a GPU) decodes exactly the exact model's greedy tokens, rejections and all, with the
    fused op taken by its draft steps."""
    import unimax

    model = pure_or_hybrid
    draft = gemv_view(quantize_view(model, "full"))
    engine = unimax.UniMaxEngine(model, draft, unimax.MaxTurboGraphDecoder(draft, block),
                                 state_safe_draft=False)
    calls = []
    spy_fused(monkeypatch, calls)
    x = torch.randint(0, model.config.vocab_size, (1, 9),
                      generator=torch.Generator().manual_seed(block))
    got, report = engine.generate_verified(x, 20)
    assert torch.equal(got, unimax.exact_greedy_tokens(model, x, 20))
    assert calls and report.generated_tokens == 20
    if block > 1:  # (these seeds: drafts rejected, the rollback taken)
        assert report.rejected_blocks >= 1


def test_compiled_folded_verifier_decodes_exact_greedy(pure_or_hybrid, monkeypatch):
    """An engine with the compiled verifier (inductor's CPU backend here, as on a GPU) over its
    folded view, the fused full-FP8 draft drafting: fixed blocks of 8 and 3 drafts and the
    adaptive length, rejections included, decode exactly the exact model's greedy tokens: the
    steps and one-token forwards through the fused op, the verifier's 9-row blocks not."""
    import unimax

    model = pure_or_hybrid
    rows = []

    def fused_op(x, *args):
        rows.append(x.shape[0])
        return fused_small_m_linear(x, *args)

    monkeypatch.setattr(fused_draft, "fused_small_m_linear", fused_op)
    draft = gemv_view(quantize_view(model, "full"))
    engine = unimax.UniMaxEngine(model, draft, unimax.MaxTurboGraphDecoder(draft, 8),
                                 state_safe_draft=False, compile_verifier=True)
    x = torch.randint(0, model.config.vocab_size, (1, 9),
                      generator=torch.Generator().manual_seed(4))
    reference = unimax.exact_greedy_tokens(model, x, 30)
    rejected = 0
    for block in (8, 3, None):
        got, report = engine.generate_verified(x, 30, draft_block=block)
        assert torch.equal(got, reference), block
        rejected += report.rejected_blocks
    assert rejected and 1 in rows and 9 not in rows


def test_fused_draft_step_compiles_in_one_graph():
    """Inductor (here its CPU backend, as the compiled step uses it on a GPU) traces the fused
    draft step with no graph break (fullgraph) through the fused ops, and the compiled steps
    compute the eager ones' logits and states (the conv windows too)."""
    from unimax import GDNForCausalLM
    from unimax.tiny import TINY_CONFIG

    model = GDNForCausalLM.random(TINY_CONFIG, seed=3)
    view = gemv_view(quantize_view(model, "full"))
    assert all(block.fused for block in view.layers)
    compiled = torch.compile(
        lambda ids, cache: view.forward_unchecked(ids, cache, logits_to_keep=1), fullgraph=True)
    caches = view.make_recurrent_cache(), view.make_recurrent_cache()
    with torch.inference_mode():
        for token in (3, 7, 11):
            ids = torch.tensor([[token]])
            got = compiled(ids, caches[0])
            expected = view.forward_unchecked(ids, caches[1], logits_to_keep=1)
            assert float((got - expected).norm() / expected.norm()) < 1e-5
    assert torch.allclose(caches[0].recurrent_buffer, caches[1].recurrent_buffer, atol=1e-5)
    # (the conv windows, rolled in place by the in-projection's op: ops.in_proj_conv)
    assert torch.allclose(caches[0].conv_buffer, caches[1].conv_buffer, atol=1e-5)


def test_folded_verifier_compiles_in_one_graph():
    """The verifier's folded view (unimax.verifier.exact_view) traces with no graph break
    (fullgraph, inductor's CPU backend) for what the verifier compiles: a recorded block of
    9 tokens (plain forms) and a one-token step (folded); the compiled forwards compute the
    eager ones' logits, tape and states."""
    from unimax import GDNForCausalLM
    from unimax.tiny import TINY_CONFIG
    from unimax.verifier import exact_view

    assert all(block.fused for block in exact_view(GDNForCausalLM.random(TINY_CONFIG)).layers)

    def step(forward, block, cache):  # (as k = 0 would)
        return forward(block[:, :1], cache, logits_to_keep=1), cache.recurrent_buffer.clone()

    for got, expected in zip(*verifier_recordings(after=step), strict=True):
        assert float((got - expected).norm() / expected.norm()) < 1e-5


def test_heads_the_gated_prologue_cannot_take_keep_the_plain_mixer(monkeypatch):
    """Value heads of 24 (not a power of 2): the mixer's part takes the plain forms, the MLP's
    is still fused, and the steps equal the unfused view's."""
    from unimax import GDNConfig, GDNForCausalLM

    config = GDNConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_k_heads=2,
                       num_v_heads=4, head_k_dim=16, head_v_dim=24, intermediate_size=96)
    model = GDNForCausalLM.random(config, seed=5)
    draft = quantize_view(model, "full")
    calls = []
    spy_fused(monkeypatch, calls)
    tokens = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(5))
    got = steps(gemv_view(draft, fuse=True), tokens)
    assert len(calls) == 5 * 2 * config.num_hidden_layers
    for a, b in zip(got, steps(gemv_view(draft, fuse=False), tokens), strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_the_verifier_view_folds_its_one_token_forwards(pure_or_hybrid, monkeypatch):
    """The verifier's view (unimax.verifier.exact_view) folds its blocks as BF16-only's step
    does for its one-token forwards, with sigmoid(b) outside the recurrence's kernel (in the
    in-projection's epilogue), and leaves its prompt and its recorded 9-token blocks to the
    plain forms; its logits and, after the rewind, its states are the unfolded view's (fp32,
    the twin); with fuse_bf16 off it folds nothing."""
    import unimax
    from helpers import cache_states
    from unimax.verifier import exact_view

    model = pure_or_hybrid
    assert kernels.active().fuse_bf16
    view, plain = exact_view(model), gemv_view(model, fuse=False)
    assert all(b.fused and not b.beta_in_kernel for b in view.layers)
    assert not any(getattr(m, "fused", False) for m in model.modules())
    rows, betas = [], []

    def spy(op):
        def fused_op(x, *args):
            rows.append(x.shape[0])
            return op(x, *args)
        return fused_op

    monkeypatch.setattr(fused_draft, "fused_small_m_linear", spy(fused_small_m_linear))
    monkeypatch.setattr(fused_draft, "fused_in_proj_conv", spy(fused_draft.fused_in_proj_conv))
    real_core = type(model.layers[0].mixer).decode_core

    def decode_core(self, projected, state, beta_in_kernel=False, conv_done=False,
                    beta_done=False):
        betas.append((beta_in_kernel, beta_done))
        return real_core(self, projected, state, beta_in_kernel, conv_done, beta_done)

    monkeypatch.setattr(type(model.layers[0].mixer), "decode_core", decode_core)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7), generator=gen)
    block = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    with torch.inference_mode():
        caches = []
        for v in (view, plain):
            cache = v.make_recurrent_cache()
            v(input_ids=prompt, past_key_values=cache, use_cache=True)
            before = cache.empty_like(share_kv=True)
            unimax.copy_cache_(before, cache)
            tape = v.make_tape(9)
            with cache.recording(tape):  # the verifier's block: 8 drafts + 1
                logits = v.forward_unchecked(block, cache)
            v.rewind_unchecked(cache, before, tape, 5)  # 4 drafts accepted
            cache.seen_tokens = before.seen_tokens + 5
            with cache.attending(cache.seen_tokens + 1):  # an exact step (k = 0) after it
                one = v.forward_unchecked(block[:, 5:6], cache)
            caches.append((logits, one, cache))
    (a, a1, got), (b, b1, want) = caches
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a1, b1, rtol=1e-5, atol=1e-5)
    for x, y in zip(cache_states(got), cache_states(want), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    blocks = model.config.num_hidden_layers
    # the step through the fused op (4 linears per block); the 7-token prompt and the block
    # in the plain forms
    assert rows == [1] * 4 * blocks, rows
    gdn = sum(not model.config.is_attention(i) for i in range(blocks))
    # (the one-token steps of both views: the folded one with beta from its in-projection's
    # epilogue, the configuration's fold_beta; the plain one rounds it from b)
    assert betas == [(False, True)] * gdn + [(False, False)] * gdn, betas
    kernels_for_test(monkeypatch, fuse_bf16=False)
    assert not any(getattr(m, "fused", False) for m in exact_view(model).modules())
