"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the fused GEMVs with their slice of W prefetched
into L2 first (unimax.ops.fused_gemv.PREFETCH) against the same kernels without, bit for
bit; and the fast steps decoding the same tokens with it on. A file of its own so that
bench/gpu_tests.sh runs it in a process of its own."""

import pytest
import torch

from helpers import gpu_model
from helpers import gpu_prompt as prompt
from unimax import build_engine

pytestmark = pytest.mark.gpu


def test_prefetched_gemvs_equal_the_plain_ones_on_gpu(monkeypatch):
    """At a 4B layer's four draft linears (in-projection with the convolution, out-projection
    with its gate and residual, MLP up, down with the residual): FP8 weights in the rows,
    rows16 and split-K forms, BF16 in the rows form, PDL on and off, and a captured graph
    whose replays follow new inputs: the prefetching launches' outputs (and the conv state
    they roll) equal the plain launches' bit for bit. The prefetch asks for nothing that any
    result reads, so only a fault or a wrong launch would show here."""
    import unimax.ops.fused_gemv as fused_gemv
    from unimax.fp8 import quantize_rows

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0+")
    gen = torch.Generator(device="cuda").manual_seed(11)
    monkeypatch.setattr(fused_gemv, "PDL", False)
    for prologue, n, k, residual, conv in (("rms", 12352, 2560, False, 8192),
                                           ("gated_silu", 2560, 4096, True, 0),
                                           ("rms", 18432, 2560, False, 0),
                                           ("swiglu", 2560, 9216, True, 0)):
        w = torch.randn(n, k, device="cuda", generator=gen) / 50
        x = 4 * torch.randn(1, 2 * k if prologue == "swiglu" else k, device="cuda",
                            generator=gen).to(torch.bfloat16)
        gated = prologue.startswith("gated")
        z = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16) if gated else None
        norm = ((1 + 0.1 * torch.randn(128 if gated else k, device="cuda", generator=gen))
                .to(torch.bfloat16) if prologue != "swiglu" else None)
        r = (torch.randn(1, n, device="cuda", generator=gen).to(torch.bfloat16)
             if residual else None)
        conv_w = (torch.randn(conv, 4, device="cuda", generator=gen).to(torch.bfloat16)
                  if conv else None)
        state = (torch.randn(1, conv, 4, device="cuda", generator=gen).to(torch.bfloat16)
                 if conv else None)
        split = ("split16@16x256x4",) if n <= fused_gemv.SPLIT_MAX_N else ()
        for (weight, scale), kernels in ((quantize_rows(w), ("rows16@16x256x4",
                                                             "rows@32x512x8", *split)),
                                         ((w.to(torch.bfloat16), None), ("rows@16x256x4",))):
            for kernel in kernels:
                for pdl in (False, True):
                    label = (prologue, n, kernel, pdl)
                    monkeypatch.setattr(fused_gemv, "PDL", pdl)
                    outputs = []
                    for prefetch in (False, True):
                        monkeypatch.setattr(fused_gemv, "PREFETCH", prefetch)
                        assert bool(fused_gemv.prefetch_launch(x, weight, False, None)) \
                            == prefetch, label  # (the prefetching form really launches)
                        was = None if state is None else state.clone()
                        y = fused_gemv.fused_gemv(x, weight, scale, n, k, prologue, norm, z, r,
                                                  1e-6, 1.0, kernel=kernel, conv_state=state,
                                                  conv_weight=conv_w)
                        outputs.append((y, None if state is None else state.clone()))
                        if was is not None:
                            state.copy_(was)  # (each launch rolls the window once)
                    assert torch.equal(outputs[0][0], outputs[1][0]), label
                    if state is not None:
                        assert torch.equal(outputs[0][1], outputs[1][1]), label
    # captured: replays with new inputs equal eager prefetching calls
    monkeypatch.setattr(fused_gemv, "PDL", False)
    monkeypatch.setattr(fused_gemv, "PREFETCH", True)
    q, s = quantize_rows(torch.randn(2560, 4096, device="cuda", generator=gen))
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    for kernel in ("rows16@16x256x4", "split16@16x256x4"):
        def call(kernel=kernel):
            return fused_gemv.fused_gemv(x, q, s, 2560, 4096, "none", kernel=kernel)

        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(3):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            graph.replay()
            monkeypatch.setattr(fused_gemv, "PREFETCH", False)
            assert torch.equal(out, call()), kernel
            monkeypatch.setattr(fused_gemv, "PREFETCH", True)


def test_fast_steps_decode_the_same_with_prefetch_on_gpu(monkeypatch):
    """The compiled BF16 step and the full-FP8 draft step, captured with PREFETCH on, decode
    the tokens they decode with it off (PDL off in both, so that the one difference is the
    prefetch)."""
    import unimax.ops.fused_gemv as fused_gemv

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0+")
    model = gpu_model()
    x = prompt(60, seed=5)
    monkeypatch.setattr(fused_gemv, "PDL", False)
    for decode, draft in (("bf16", "tail"), ("fp8", "full")):
        tokens = []
        for prefetch in (False, True):
            monkeypatch.setattr(fused_gemv, "PREFETCH", prefetch)
            engine = build_engine(model, decode=decode, draft=draft, block_size=8,
                                  compile_step=True)
            tokens.append(engine.generate_fast(x, 24))
        assert torch.equal(tokens[0], tokens[1]), decode
