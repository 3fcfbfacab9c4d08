"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the fused GEMVs' TMA forms (unimax.ops.fused_gemv).
A file of its own, beside tests/test_gpu_fused.py, so that bench/gpu_tests.sh runs it in a
process of its own (seventeenth session: the two tests in one file ran past its 560 s)."""

import pytest
import torch

from helpers import assert_in_proj_conv_matches_twin, assert_replays_match_eager, rel_err

pytestmark = pytest.mark.gpu


def test_tma_gemv_on_gpu():
    """The TMA forms (ops.fused_gemv.TMA_FORMS: W's tiles through tensor descriptors,
    pipelined into shared memory) at a 4B model's four draft linears, FP8 with fp32 and FP16
    products (split-K too where offered) and BF16: the twin's outputs; in a captured graph,
    replays with new inputs give what eager calls give (the descriptor is a launch argument,
    kept by the graph; split-K's counters set back). (The timed choice among them and the
    plain forms: test_fused_draft_on_gpu's steps.)"""
    import unimax.ops.fused_gemv as fused_gemv
    from unimax.fp8 import quantize_rows

    assert fused_gemv.TMA and torch.cuda.get_device_capability()[0] >= 9
    gen = torch.Generator(device="cuda").manual_seed(7)
    for prologue, n, k, residual in (("rms", 12352, 2560, False), ("gated_silu", 2560, 4096, True),
                                     ("rms", 18432, 2560, False), ("swiglu", 2560, 9216, True)):
        w = torch.randn(n, k, device="cuda", generator=gen) / 50
        x = 4 * torch.randn(1, 2 * k if prologue == "swiglu" else k, device="cuda",
                            generator=gen).to(torch.bfloat16)
        gated = prologue.startswith("gated")
        z = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16) if gated else None
        norm = ((1 + 0.1 * torch.randn(128 if gated else k, device="cuda", generator=gen))
                .to(torch.bfloat16) if prologue != "swiglu" else None)
        r = (torch.randn(1, n, device="cuda", generator=gen).to(torch.bfloat16)
             if residual else None)
        split = (("tmasplit16@32x256x4x4", "tmasplit", "tmasplit@16x256x4x4")
                 if n <= fused_gemv.SPLIT_MAX_N else ())
        fp8 = ("tma@32x256x4x4", "tma16", "tma16@64x128x4x4") + split
        for (weight, scale), kernels in ((quantize_rows(w), fp8),
                                         ((w.to(torch.bfloat16), None), ("tma",))):
            ref = fused_gemv.fused_small_m_linear_ref(x, weight, scale, n, k, prologue, norm, z,
                                                      r, 1e-6, 1.0)
            for kernel in kernels:
                got = fused_gemv.fused_gemv(x, weight, scale, n, k, prologue, norm, z, r, 1e-6,
                                            1.0, kernel=kernel)
                assert rel_err(got.float(), ref.float()) < 1e-2, (prologue, n, kernel)
    # captured: the descriptor's address and box stay in the graph, x changes under it
    q, s = quantize_rows(torch.randn(2560, 4096, device="cuda", generator=gen))
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)

    for kernel in ("tma16@32x256x4x4", "tmasplit16@16x256x4x4", "tma16", "tmasplit16"):
        assert_replays_match_eager(
            lambda kernel=kernel: fused_gemv.fused_gemv(x, q, s, 2560, 4096, "none",
                                                        kernel=kernel), x, gen, kernel)
    # the TMA forms with the convolution folded in, at their default tile (none named: the
    # conv's default tile is the rows form's, three numbers, where a TMA form needs four: an
    # IndexError here, eighteenth session): the twin's outputs and windows at the 4B
    # in-projection (tma16 for the FP8 weights, tma for the BF16 ones)
    assert_in_proj_conv_matches_twin(
        lambda x, weight, scale, norm, state, conv_w: fused_gemv.fused_gemv(
            x, weight, scale, 12352, 2560, "rms", norm, eps=1e-6, offset=1.0,
            kernel="tma" if scale is None else "tma16", conv_state=state,
            conv_weight=conv_w), gen, "tma")
