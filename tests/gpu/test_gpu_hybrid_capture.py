"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): a hybrid model's every graph captured up front, as
the app does, then a prompt that leaves the context's last tokens to a verified reply. Split
from tests/gpu/test_gpu_hybrid.py (its hybrid test took 496 s of a file's 560 on the H200)
so that tests/gpu.sh runs the two side by side."""

import pytest
import torch

import unimax
from unimax import build_engine

pytestmark = pytest.mark.gpu


def test_hybrid_captured_up_front_on_gpu(tmp_path):
    """Every graph of a verified hybrid engine captured up front (as the app does) with a
    short-prefill bucket as long as the KV buffers (512), then a 500-token prompt in it: the
    verified reply is the exact model's greedy tokens up to a near tie."""
    from helpers import write_qwen_checkpoint
    from unimax.reference import first_divergence, is_near_tie

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    write_qwen_checkpoint(tmp_path, seed=4, num_layers=4, layer_types=layer_types)
    model = unimax.load_model(tmp_path, device="cuda", dtype="bfloat16", max_context=512)
    g = build_engine(model, decode="fp8", draft="full", block_size=8)
    g.capture_graphs(verified=True)  # (each warm-up from position 0: the 512 bucket fits)
    long = torch.randint(0, 97, (1, 500), device="cuda")
    got = g.generate_verified(long, 12)[0][0].tolist()  # (its prompt in the padded 512 graph)
    reference = unimax.exact_greedy_tokens(model, long, 12)[0].tolist()
    assert is_near_tie(first_divergence(model, long, got, reference))
