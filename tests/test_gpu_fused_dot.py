"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the fused tensor-core form for a verifier block's
rows (unimax.ops.fused_dot) at a 4B model's four linears, with PDL in a graph, and the
compiled verifier with its blocks folded (unimax.verifier.FOLD_BLOCKS) decoding exact greedy.
A file of its own so that bench/gpu_tests.sh runs it in a process of its own."""

import pytest
import torch
from test_gpu_tma import assert_pdl_graph_matches_plain, pdl_problem

from helpers import assert_verified_exact_on_gpu, gpu_model, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return gpu_model()


def linear_case(gen, prologue: str, n: int, k: int, residual: bool, rows: int = 9):
    """A 4B linear's inputs for ``prologue``: x (rows of it), z, the norm's weight, r."""
    x = 4 * torch.randn(rows, 2 * k if prologue == "swiglu" else k, device="cuda",
                        generator=gen).to(torch.bfloat16)
    gated = prologue.startswith("gated")
    z = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16) if gated else None
    norm = ((1 + 0.1 * torch.randn(128 if gated else k, device="cuda", generator=gen))
            .to(torch.bfloat16) if prologue in ("rms", "gated_silu") else None)
    r = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16) if residual \
        else None
    return x, z, norm, r


def test_fused_dot_on_gpu():
    """A 4B model's in-projection (RMS), out-projection (gated norm, residual), gate-up (RMS)
    and down-projection (SwiGLU, residual) at 9 rows, BF16 and FP8 weights, "dot" and split-K
    "dotsplit" at their default tiles and at the per-shape choice: the twin's outputs (BF16
    rounding); without a prologue, the plain GEMM's at the same tile bit for bit."""
    from unimax.fp8 import quantize_rows
    from unimax.ops import fused_gemv, gemv
    from unimax.ops.fused_dot import fused_dot

    gen = torch.Generator(device="cuda").manual_seed(5)
    for prologue, n, k, residual in (("rms", 12352, 2560, False), ("gated_silu", 2560, 4096, True),
                                     ("rms", 18432, 2560, False), ("swiglu", 2560, 9216, True)):
        w = torch.randn(n, k, device="cuda", generator=gen) / 50
        x, z, norm, r = linear_case(gen, prologue, n, k, residual)
        q, s = quantize_rows(w)
        for weight, scale in ((w.to(torch.bfloat16), None), (q, s)):
            args = (x, weight, scale, n, k, prologue, norm, z, r, 1e-6, 1.0)
            ref = fused_gemv.fused_small_m_linear_ref(*args)
            chosen = fused_gemv.fused_small_m_linear(*args)  # (the timed choice)
            assert rel_err(chosen, ref) < 1e-2, (prologue, weight.dtype)
            for kernel in ("dot", "dotsplit"):
                y = fused_dot(*args, kernel=kernel)
                assert rel_err(y, ref) < 1e-2, (prologue, weight.dtype, kernel, rel_err(y, ref))
        plain = gemv.gemv(x[:, :k].contiguous(), w.to(torch.bfloat16), kernel="dot@64x256x4x3")
        bare = fused_dot(x[:, :k].contiguous(), w.to(torch.bfloat16), None, n, k, "none",
                         kernel="dot@64x256x4x3")
        assert torch.equal(bare, plain), prologue
    print("choices", {key[:3]: v for key, v in fused_gemv.CHOICES.items() if key[2] == 9})


def test_fused_dot_pdl_on_gpu(monkeypatch):
    """With programmatic dependent launch in a captured graph: a GEMM writes x, a PDL fused
    GEMM (RMS prologue, so its pre-pass reads x after the wait) waits for it, a second (SwiGLU
    prologue, split-K, residual) waits for that one: both equal the plain launches bit for bit
    after the inputs change."""
    from unimax.ops.fused_dot import fused_dot

    gen, k, n, a, b = pdl_problem(rows=9, seed=9)
    w1 = (torch.randn(2 * n, k, device="cuda", generator=gen) / 50).to(torch.bfloat16)
    w2 = (torch.randn(k, n, device="cuda", generator=gen) / 100).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)

    def body():
        x = a @ b  # the GEMM the first PDL GEMM must wait for
        gate_up = fused_dot(x, w1, None, 2 * n, k, "rms", norm, offset=1.0, kernel="dot")
        return gate_up, fused_dot(gate_up, w2, None, k, n, "swiglu", residual=x,
                                  kernel="dotsplit")

    assert_pdl_graph_matches_plain(monkeypatch, body, a, w1, "fused dot")


def test_folded_verifier_blocks_are_exact_on_gpu(model, monkeypatch):
    """The compiled verifier with its blocks folded (FOLD_BLOCKS): its 9-row blocks run the
    fused tensor-core form, and verified replies (full and tail drafts) are exact greedy up to
    BF16 near-ties against the one-token eager reference."""
    import unimax.verifier as verifier
    from unimax.ops import fused_gemv

    monkeypatch.setattr(verifier, "FOLD_BLOCKS", True)
    assert_verified_exact_on_gpu(model, seed=21)
    assert any(key[2] == 9 for key in fused_gemv.CHOICES), fused_gemv.CHOICES  # (folded)
