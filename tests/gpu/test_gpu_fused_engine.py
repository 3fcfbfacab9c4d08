"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the engines compiled over the fused GEMVs (the
fused full-FP8 draft and the fused BF16 fast step). Apart from tests/gpu/test_gpu_fused.py so
that tests/gpu.sh runs the two side by side (together they ran
past one file's 560 s)."""

import pytest
import torch

import unimax
from helpers import gpu_model
from helpers import gpu_prompt as prompt
from unimax import build_engine, kernels
from unimax.reference import first_divergence, is_near_tie

pytestmark = pytest.mark.gpu


def test_fused_engines_on_gpu():
    """The compiled fused draft in captured graphs decodes what it decodes eagerly; the fused BF16
    fast step (the kernel configuration's fuse_bf16) decodes the exact model's tokens up to BF16
    near-ties, as the unfused compiled step does."""
    model = gpu_model()
    assert kernels.active().fuse_fp8  # the default: build_engine's compiled draft is the fused one
    x = prompt(60, seed=6)
    graphs = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    assert all(block.fused for block in graphs.decode_model.layers)
    eager = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True,
                         use_graphs=False)
    assert torch.equal(graphs.generate_fast(x, 32), eager.generate_fast(x, 32))
    print("fused draft graphs checked; now the fused BF16 step")  # (the log's time marks)
    assert kernels.active().fuse_bf16
    bf16 = build_engine(model, decode="bf16", block_size=8, compile_step=True)
    assert all(block.fused for block in bf16.decode_model.layers)
    assert not any(getattr(block, "fused", False) for block in model.layers)
    got = bf16.generate_fast(x, 48)[0].tolist()
    reference = unimax.exact_greedy_tokens(model, x, 48)[0].tolist()
    assert is_near_tie(first_divergence(model, x, got, reference))
