"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the engines compiled over the fused GEMVs (the
fused full-FP8 draft and the fused BF16 fast step). Apart from tests/test_gpu_fused.py so
that bench/gpu_tests.sh runs the two side by side (seventeenth session: together they ran
past one file's 560 s)."""

import pytest
import torch

import unimax
import unimax.fused_draft as fused_draft
from helpers import gpu_model
from helpers import gpu_prompt as prompt
from unimax import build_engine
from unimax.reference import first_divergence, is_near_tie

pytestmark = pytest.mark.gpu


def test_fused_engines_on_gpu():
    """The compiled fused draft in captured graphs decodes what it decodes eagerly; the fused
    BF16 fast step (FUSE_BF16) decodes the exact model's tokens up to BF16 near-ties, as the
    unfused compiled step does."""
    model = gpu_model()
    assert fused_draft.FUSE  # the default: build_engine's compiled draft is the fused one
    x = prompt(60, seed=6)
    graphs = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    assert all(block.fused for block in graphs.decode_model.layers)
    eager = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True,
                         use_graphs=False)
    assert torch.equal(graphs.generate_fast(x, 32), eager.generate_fast(x, 32))
    print("fused draft graphs checked; now the fused BF16 step")  # (the log's time marks)
    assert fused_draft.FUSE_BF16
    bf16 = build_engine(model, decode="bf16", block_size=8, compile_step=True)
    assert all(block.fused for block in bf16.decode_model.layers)
    assert not any(getattr(block, "fused", False) for block in model.layers)
    got = bf16.generate_fast(x, 48)[0].tolist()
    reference = unimax.exact_greedy_tokens(model, x, 48)[0].tolist()
    assert is_near_tie(first_divergence(model, x, got, reference))


def test_draft_mlp_in_one_launch_on_gpu(monkeypatch):
    """ops.fused_mlp (FUSED_MLP, off by default) in verified mode's full draft: every block
    marked, the kernel's outputs at every tile those of the two fused GEMVs it replaces up to
    fp32 summation order, and verified decoding with it (the per-shape timed choice) exact
    greedy decoding up to BF16 near-ties, its acceptance that of the two-GEMV draft's (the
    same draft, summed in another order)."""
    from unimax.ops import fused_mlp
    from unimax.ops.fused_gemv import fused_gemv

    model = gpu_model()
    x = prompt(80, seed=12)
    plain = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    assert not any(getattr(b, "mlp_one_launch", False) for b in plain.decode_model.layers)
    monkeypatch.setattr(fused_mlp, "FUSED_MLP", True)
    one = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    assert all(b.mlp_one_launch for b in one.decode_model.layers)
    block = one.decode_model.layers[0]
    mlp, norm = block.mlp, block.mlp_norm
    h = (torch.randn(1, model.config.hidden_size, device="cuda") * 3).to(torch.bfloat16)
    hidden, inter = model.config.hidden_size, mlp.intermediate_size
    args = (mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale)
    gate_up = fused_gemv(h, *args, 2 * inter, hidden, "rms", norm_weight=norm.weight,
                         eps=norm.eps, offset=getattr(norm, "offset", 0.0))
    pair = fused_gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.weight_scale, hidden, inter,
                      "swiglu", residual=h)
    for tile in fused_mlp.TILES * 2:  # (each launch leaves its row and counter zeroed)
        got = fused_mlp.fused_mlp(h, *args, mlp.down_proj.weight, mlp.down_proj.weight_scale,
                                  hidden, inter, norm.weight, norm.eps,
                                  getattr(norm, "offset", 0.0), tile)
        delta = (pair.float() - h.float()).norm()
        assert float((got.float() - pair.float()).norm() / delta) < 1e-2, tile
    reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
    rates = []
    for engine in (one, plain):
        got, report = engine.generate_verified(x, 64)
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), divergence
        rates.append(report.acceptance_rate)
    print("acceptance one launch / two", rates, "choices", fused_mlp.CHOICES)
    assert rates[0] >= rates[1] - 0.1
