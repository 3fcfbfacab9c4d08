"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the fused GEMVs' TMA forms and their programmatic
dependent launches (unimax.ops.fused_gemv). A file of its own, beside tests/gpu/test_gpu_fused.py,
so that tests/gpu.sh runs it in a process of its own (the two tests
in one file ran past its 560 s: the PDL test, then in
tests/gpu/test_gpu_engine.py, was cut there at 560 s)."""

import pytest
import torch

from helpers import (
    assert_in_proj_conv_matches_twin,
    assert_replays_match_eager,
    gpu_model,
    kernels_for_test,
    rel_err,
)
from helpers import gpu_prompt as prompt
from unimax import build_engine, kernels
from unimax.ops import pdl

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

    assert kernels.active().tma and torch.cuda.get_device_capability()[0] >= 9
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
        for (weight, scale), forms in ((quantize_rows(w), fp8),
                                       ((w.to(torch.bfloat16), None), ("tma",))):
            ref = fused_gemv.fused_small_m_linear_ref(x, weight, scale, n, k, prologue, norm, z,
                                                      r, 1e-6, 1.0)
            for kernel in forms:
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
    # IndexError here): the twin's outputs and windows at the 4B
    # in-projection (tma16 for the FP8 weights, tma for the BF16 ones)
    assert_in_proj_conv_matches_twin(
        lambda x, weight, scale, norm, state, conv_w: fused_gemv.fused_gemv(
            x, weight, scale, 12352, 2560, "rms", norm, eps=1e-6, offset=1.0,
            kernel="tma" if scale is None else "tma16", conv_state=state,
            conv_weight=conv_w), gen, "tma")


@pytest.fixture(scope="module")
def model():
    return gpu_model()


def pdl_problem(rows: int, seed: int):
    """The PDL kernel tests' inputs (skipped below compute capability 9): a generator, K and N
    at the 4B MLP's sizes, and a GEMM's operands a (rows, 4096) @ b (4096, K) whose output
    the first PDL kernel must wait for."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, n = 2560, 9216
    a = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(4096, k, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    return gen, k, n, a, b


def assert_pdl_graph_matches_plain(monkeypatch, body, a, weight, label) -> None:
    """``body()`` (reading ``a``, writing through kernels of ops.fused_gemv's PDL setting)
    captured in a graph with PDL on, then ``a`` changed: the replay equals the PDL-free
    kernels' outputs bit for bit (a kernel that read its input before the one writing it had
    finished would show the old values)."""

    kernels_for_test(monkeypatch, pdl=True)
    assert pdl.pdl_launch(a, weight)["launch_pdl"]  # (the PDL form really launches)
    body()  # (warm-up: compile and autotune outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = body()
    a.mul_(-1.5)
    kernels_for_test(monkeypatch, pdl=False)
    want = body()
    graph.replay()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), label


def test_fused_gemv_pdl_on_gpu(model, monkeypatch):
    """The fused GEMVs with programmatic dependent launch (the kernel configuration's pdl set on):
    in a captured graph, a GEMM writes x, a PDL GEMV (RMS prologue) waits for it, and a second
    PDL GEMV (residual add), launched early by the first, waits for that one: both outputs
    equal the PDL-free kernels' bit for bit (the same tiles and sums) after the inputs change,
    FP8 with either product form and BF16, the signal at the start or the end. Then the fused
    BF16 fast step decodes the same tokens in its graphs with PDL on as with it off, and the
    full-FP8 step with PDL for FP8 weights only ("fp8") as without."""
    import unimax.ops.fused_gemv as fused_gemv
    from unimax.fp8 import quantize_rows

    gen, k, n, a, b = pdl_problem(rows=1, seed=6)
    norm = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    w1, w2 = torch.randn(n, k, device="cuda", generator=gen), torch.randn(k, n, device="cuda",
                                                                          generator=gen)
    fp8 = [quantize_rows(w) for w in (w1, w2)]
    bf16 = [(w.to(torch.bfloat16), None) for w in (w1 / 50, w2 / 100)]
    for weights, kernel, trigger in ((fp8, "rows", "start"), (fp8, "rows16", "start"),
                                     (bf16, "rows", "start"), (fp8, "rows16", "end"),
                                     (bf16, "rows", "end")):
        (q1, s1), (q2, s2) = weights
        kernels_for_test(monkeypatch, pdl_trigger=trigger)

        def body(q1=q1, s1=s1, q2=q2, s2=s2, kernel=kernel):
            x = a @ b  # the GEMM the first GEMV must wait for
            h = fused_gemv.fused_gemv(x, q1, s1, n, k, "rms", norm, None, None, 1e-6, 1.0,
                                      kernel=kernel)
            return h, fused_gemv.fused_gemv(h, q2, s2, k, n, "none", None, None, x, 1e-6, 0.0,
                                            kernel=kernel)

        assert_pdl_graph_matches_plain(monkeypatch, body, a, q1, (kernel, trigger))
    kernels_for_test(monkeypatch, pdl_trigger="start")
    kernels_for_test(monkeypatch, pdl=False)  # (not "auto", the default: timed)
    x = prompt(60, seed=3)
    plain = build_engine(model, decode="bf16", block_size=8, compile_step=True)
    expected = plain.generate_fast(x, 24)
    kernels_for_test(monkeypatch, pdl=True)
    early = build_engine(model, decode="bf16", block_size=8, compile_step=True)
    assert torch.equal(early.generate_fast(x, 24), expected)
    # PDL "fp8": the full-FP8 draft step's GEMVs launched early, its tokens unchanged
    kernels_for_test(monkeypatch, pdl=False)
    expected = build_engine(model, decode="fp8", draft="full", block_size=8,
                            compile_step=True).generate_fast(x, 24)
    kernels_for_test(monkeypatch, pdl="fp8")
    early = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    assert torch.equal(early.generate_fast(x, 24), expected)


def test_dot_gemm_pdl_on_gpu(monkeypatch):
    """The verifier's tensor-core GEMMs (ops.gemv "dot", "dotsplit", the SwiGLU epilogue) with
    programmatic dependent launch: in a captured graph a GEMM writes x, a PDL GEMM of 9 rows
    waits for it, a second PDL GEMM, launched early by the first, waits for that one: the
    outputs equal the plain launches' bit for bit after the inputs change, the signal at the
    start or the end."""
    import unimax.ops.gemv as gemv_ops

    gen, k, n, a, b = pdl_problem(rows=9, seed=7)
    w1 = (torch.randn(2 * n, k, device="cuda", generator=gen) / 50).to(torch.bfloat16)
    w2 = (torch.randn(k, n, device="cuda", generator=gen) / 100).to(torch.bfloat16)
    for first, second, trigger in (("dot", "dot", "start"), ("dot", "dotsplit", "start"),
                                   ("swiglu", "dotsplit", "end"), ("dot", "dot", "end")):
        kernels_for_test(monkeypatch, pdl_trigger=trigger)

        def body(first=first, second=second):
            x = a @ b  # the GEMM the first PDL GEMM must wait for
            h = gemv_ops.gemv(x, w1, kernel="dot", swiglu=True) if first == "swiglu" else \
                gemv_ops.gemv(x, w1[:n], kernel="dot")
            return h, gemv_ops.gemv(h, w2, kernel=second)

        assert_pdl_graph_matches_plain(monkeypatch, body, a, w1, (first, second, trigger))


def test_pdl_auto_is_timed_per_decoder_on_gpu(model, monkeypatch):
    """PDL "auto" (the default): the BF16 fast step's decoder and the full-FP8 draft's each
    time their largest block plain and with PDL on their fused GEMVs (every one for BF16, the
    FP8 ones for the draft) signalled at the start and at the end, keep the fastest graph
    under its time, and decode the tokens the
    plain decoder decodes; the compiled verifier times its full block and its exact run plain
    and with PDL on its Triton GEMMs and GEMVs, and a verified reply with both choices equals
    the all-plain engine's, bit for bit, and exact greedy up to a near tie. (The choices'
    logic: tests/ops/test_pdl_auto.py.)"""
    from unimax import exact_greedy_tokens
    from unimax.graph import pdl_candidate
    from unimax.reference import first_divergence, is_near_tie

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    x = prompt(60, seed=4)
    for decode, draft, candidate in (("bf16", "tail", True), ("fp8", "full", "fp8")):
        kernels_for_test(monkeypatch, pdl=False)
        plain = build_engine(model, decode=decode, draft=draft, block_size=8, compile_step=True)
        expected = plain.generate_fast(x, 24)
        assert plain.decode_graph.pdl is False and plain.decode_graph.pdl_ms == {}
        kernels_for_test(monkeypatch, pdl="auto")
        auto = build_engine(model, decode=decode, draft=draft, block_size=8, compile_step=True)
        assert pdl_candidate(auto.decode_model) == candidate
        got = auto.generate_fast(x, 24)
        graph = auto.decode_graph
        print(decode, draft, "PDL timed (ms a block of 8):", graph.pdl_ms, "kept", graph.pdl)
        assert set(graph.pdl_ms) == {"False", str(candidate), f"{candidate}@end"}
        assert graph.pdl in (False, candidate)
        kept = pdl.pdl_label(graph.pdl, graph.pdl_trigger)
        assert graph.runner.replay_ms[(8, False)] == graph.pdl_ms[kept] == min(
            graph.pdl_ms.values())
        assert torch.equal(got, expected), (decode, graph.pdl)
    # the verified reply with the kept draft and verifier equals the plain engine's (the same
    # sums in the same order), and exact greedy but where they meet a near tie: with this
    # prompt every PDL setting, plain launches too, leaves the one-token reference at token 3
    # by one BF16 ulp, where its two exact paths agree (bench/pdl_exactness.py)
    tokens, _ = auto.generate_verified(x, 24)
    verifier = auto.verifier
    print("verifier PDL timed (ms a block of 8):", verifier.pdl_ms, "kept", verifier.pdl,
          "an exact run of 8:", verifier.pdl_run_ms, "kept", verifier.pdl_run)
    for key, ms, kept, trigger in (
            (verifier.graph_key(8, verifier.span(8, 0), None, False), verifier.pdl_ms,
             verifier.pdl, verifier.pdl_trigger),
            (verifier.run_key(8, None, False), verifier.pdl_run_ms, verifier.pdl_run,
             verifier.pdl_run_trigger)):
        assert set(ms) == {"False", "True", "True@end"} and kept in (False, True)
        assert verifier.runner.replay_ms[key] == ms[pdl.pdl_label(kept, trigger)] == min(
            ms.values())
    kernels_for_test(monkeypatch, pdl=False)
    assert torch.equal(tokens, plain.generate_verified(x, 24)[0])
    assert plain.verifier.pdl is False
    reference = exact_greedy_tokens(model, x, 24)[0].tolist()
    assert is_near_tie(first_divergence(model, x, tokens[0].tolist(), reference))
