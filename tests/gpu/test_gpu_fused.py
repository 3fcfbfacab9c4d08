"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the fused full-FP8 draft (unimax.fused_draft) and the
fused BF16 fast step. A file of its own so that tests/gpu.sh runs it in a process beside
the other GPU test files (together they pass one call's 10 minutes); its compiled engines in
test_gpu_fused_engine.py, for the same reason."""

import copy

import pytest
import torch

from helpers import GPU_CONFIG as CONFIG
from helpers import (
    assert_in_proj_conv_matches_twin,
    assert_replays_match_eager,
    gpu_model,
    rel_err,
)
from helpers import gpu_prompt as prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return gpu_model()


def test_fused_draft_on_gpu(model, monkeypatch):
    """The draft's fused GEMVs (unimax.ops.fused_gemv) equal their twin on the GPU at a 4B
    model's shapes, each prologue, FP8 weights with fp32 and FP16 products (a TMA form
    too; the RMS prologue also without its pre-pass), with and without the residual; a
    full-FP8 draft view's fused steps track the unfused view's logits with the fused kernel
    really taken. (The compiled engines over them: tests/gpu/test_gpu_fused_engine.py.)"""
    import unimax.fused_draft as fused_draft
    import unimax.ops.fused_gemv as fused_gemv
    from helpers import spied
    from unimax.fast_step import gemv_view
    from unimax.fp8 import quantize_rows, quantize_view
    from unimax.ops.gemv import tile_text

    gen = torch.Generator(device="cuda").manual_seed(4)
    for prologue, n, k in (("rms", 12352, 2560), ("gated_silu", 2560, 4096),
                           ("gated_sigmoid", 2560, 4096), ("swiglu", 2560, 9216),
                           ("sigmoid_gate", 2560, 4096), ("none", 18432, 2560)):
        q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=gen))
        x = 4 * torch.randn(1, 2 * k if prologue == "swiglu" else k, device="cuda",
                            generator=gen).to(torch.bfloat16)
        gated = prologue.startswith("gated")
        z = (torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
             if gated or prologue == "sigmoid_gate" else None)
        norm = (1 + 0.1 * torch.randn(128 if gated else k, device="cuda", generator=gen)
                ).to(torch.bfloat16) if prologue in ("rms", "gated_silu", "gated_sigmoid") else None
        for residual in (None, torch.randn(1, n, device="cuda", generator=gen).to(torch.bfloat16)):
            ref = fused_gemv.fused_small_m_linear_ref(x, q, s, n, k, prologue, norm, z,
                                                      residual, 1e-6, 1.0)
            split = ("split", "split16") if n <= fused_gemv.SPLIT_MAX_N else ()  # (as offered)
            # each form at a named tile, the narrowest and the widest by turns (autotuning
            # every form at every case compiled ~500 kernels: most of this file's 10 minutes;
            # every tile is checked on the interpreter,
            # tests/engine/test_fused_draft.py); a TMA form at every prologue (W through tensor
            # descriptors, pipelined; each form and tile at the 4B linears: test_gpu_tma.py)
            tiles = fused_gemv.tiles_for(fused_gemv._head(prologue, norm))
            for j, form in enumerate(("rows", "rows16") + split + ("tma16",)):
                tile = tile_text(tiles[-(j % 2)] if form != "tma16" else fused_gemv.TMA_TILE)
                got = fused_gemv.fused_gemv(x, q, s, n, k, prologue, norm, z, residual, 1e-6,
                                            1.0, kernel=(kernel := f"{form}@{tile}"))
                assert rel_err(got.float(), ref.float()) < 1e-2, (prologue, kernel)
    # split-K in a captured graph: its counters are set back by each launch, so replays with
    # new inputs give what eager calls give (fp32 slices added in order: bit for bit)
    q, s = quantize_rows(torch.randn(2560, 9216, device="cuda", generator=gen))
    x = torch.randn(1, 2 * 9216, device="cuda", generator=gen).to(torch.bfloat16)
    for kernel in ("split@16x512x8", "split16@16x512x8"):
        assert_replays_match_eager(
            lambda kernel=kernel: fused_gemv.fused_gemv(x, q, s, 2560, 9216, "swiglu",
                                                        kernel=kernel), x, gen, kernel)

    # the in-projection with the convolution folded in (ops.in_proj_conv) at the 4B
    # in-projection, through the op (its timed choice on a copy of the state): the twin's
    # outputs, and the windows rolled in place with the projection's new inputs
    from unimax.ops.in_proj_conv import fused_in_proj_conv

    assert_in_proj_conv_matches_twin(
        lambda x, weight, scale, norm, state, conv_w: fused_in_proj_conv(
            x, weight, scale, 12352, 2560, norm, 1e-6, 1.0, state, conv_w), gen, "op")

    print("twins checked; now the draft views")  # (the log's time marks: tests/gpu.sh)
    # In fp32 the fused view computes the unfused view's logits (up to the FP16 products' order,
    # bench/fused_accuracy.py: 0.0000 with fp32 products everywhere, 7e-4 with FP16). In BF16
    # the two round in different places (sums in other orders, sigmoid(b) unrounded) and on
    # this random model drift apart by ~2% on average (both ~2.1% from the fp32 draft, 40
    # steps on the H200), single steps more (a 3.4% step, and a 12% one against fp32 seen).
    draft, draft32 = (quantize_view(m, "full") for m in (model, copy.deepcopy(model).float()))
    views = [gemv_view(d, fuse=f) for d in (draft, draft32) for f in (True, False)]
    tokens = prompt(20, seed=5)
    caches = [view.make_recurrent_cache() for view in views]
    errors = {"bf16": [], "fp32": []}
    with torch.inference_mode():
        views[0](input_ids=tokens[:, :1], past_key_values=views[0].make_recurrent_cache(),
                 use_cache=True)  # (first use: each shape's kernel choice, timed)
        calls = []
        monkeypatch.setattr(fused_gemv, "fused_gemv",
                            spied(fused_gemv.fused_gemv, "fused", calls))
        monkeypatch.setattr(fused_draft, "fused_in_proj_conv",
                            spied(fused_draft.fused_in_proj_conv, "conv", calls))
        for i in range(tokens.shape[1]):
            a, b, a32, b32 = (view(input_ids=tokens[:, i: i + 1], past_key_values=cache,
                                   use_cache=True).logits.float()
                              for view, cache in zip(views, caches, strict=True))
            errors["bf16"].append(rel_err(a, b))
            errors["fp32"].append(rel_err(a32, b32))
    print("fused vs unfused draft view, rel err", {k: (sum(v) / len(v), max(v))
                                                   for k, v in errors.items()})
    assert max(errors["fp32"]) < 1e-2
    assert sum(errors["bf16"]) / len(errors["bf16"]) < 5e-2  # (the CPU test's BF16 bound)
    # both fused views, 4 fused GEMVs per layer: the in-projection with the convolution
    # folded in (the kernel configuration's fold_conv, on) and 3 plain ones
    steps = 2 * 20 * CONFIG.num_hidden_layers
    assert calls.count("conv") == steps and calls.count("fused") == 3 * steps, calls[:8]
