"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): a hybrid model's graphs and verified decoding, the
tape rewind with fla's kernel, the verifier's attention on the tensor cores. Split from
tests/gpu/test_gpu_verified.py (the two together ran past one device call's 560 s per file on the
H200) so that tests/gpu.sh runs them side by side."""

import pytest
import torch

import unimax
from helpers import GPU_CONFIG as CONFIG
from helpers import rel_err
from unimax import GDNForCausalLM, build_engine

pytestmark = pytest.mark.gpu


def hybrid_model(tmp_path):
    """A 4-layer Qwen3.5 hybrid (three GDN layers, one gated attention) written by
    transformers, loaded on the GPU in BF16, and a 120-token prompt."""
    from helpers import write_qwen_checkpoint

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    write_qwen_checkpoint(tmp_path, seed=4, num_layers=4, layer_types=layer_types)
    model = unimax.load_model(tmp_path, device="cuda", dtype="bfloat16", max_context=512)
    return model, torch.randint(0, 97, (1, 120), device="cuda")


def assert_verified_graphs_match_eager(model, x, draft: str) -> None:
    g = build_engine(model, decode="fp8", draft=draft, block_size=8)
    e = build_engine(model, decode="fp8", draft=draft, block_size=8, use_graphs=False)
    assert torch.equal(g.generate_verified(x, 40)[0], e.generate_verified(x, 40)[0])


def test_hybrid_graphs_on_gpu(tmp_path):
    """Hybrid model (gated attention over static KV buffers) on the GPU: graph decoding equals
    eager decoding; verified decoding with captured verifier/replay rolls KV back correctly
    (the tail draft here, the full-FP8 one in tests/gpu/test_gpu_hybrid_full.py: together they
    took 487 s of a process's 560). (Every graph captured up front, then
    a prompt as long as the KV buffers allow: tests/gpu/test_gpu_hybrid_capture.py, a file of its
    own: together they took 496 s of the 560 a file has.)"""
    model, x = hybrid_model(tmp_path)
    graphs = build_engine(model, decode="bf16", block_size=8)
    eager = build_engine(model, decode="bf16", block_size=8, use_graphs=False)
    assert torch.equal(graphs.generate_fast(x, 40), eager.generate_fast(x, 40))
    assert_verified_graphs_match_eager(model, x, "tail")


@torch.inference_mode()
def test_rewind_on_gpu_equals_a_forward_over_the_prefix():
    """The tape rewind with fla's recurrent kernel (the GPU path) against a plain prefill."""
    fp32 = GDNForCausalLM.random(CONFIG, device="cuda", dtype=torch.float32, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt_ids = torch.randint(0, CONFIG.vocab_size, (1, 40), device="cuda", generator=gen)
    block = torch.randint(0, CONFIG.vocab_size, (1, 8), device="cuda", generator=gen)
    cache = fp32.make_recurrent_cache()
    fp32(input_ids=prompt_ids, past_key_values=cache, use_cache=True)
    before = cache.empty_like()
    unimax.copy_cache_(before, cache)
    tape = fp32.make_tape(8)
    with cache.recording(tape):
        fp32.forward_unchecked(block, cache)
    for length in (1, 4, 8):
        fp32.rewind_unchecked(cache, before, tape, length)
        expected = fp32.make_recurrent_cache()
        fp32(input_ids=torch.cat([prompt_ids, block[:, :length]], dim=1),
             past_key_values=expected, use_cache=True)
        assert rel_err(cache.recurrent_buffer, expected.recurrent_buffer) < 5e-3
        assert rel_err(cache.conv_buffer, expected.conv_buffer) < 1e-6
        assert int(cache.position) == 40 + length


def test_rows_attention_tensor_cores_on_gpu():
    """The verifier block's attention on the tensor cores (torch.bmm with fp32 output) against
    its fp32 form and fp32 SDPA, at Qwen3.5-0.8B's heads, over a slice of a longer KV buffer."""
    from unimax.attention import rows_attention

    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 8, 9, 256, device="cuda", generator=gen).bfloat16()
    buffer = torch.randn(2, 1, 2, 4096, 256, device="cuda", generator=gen).bfloat16()
    k, v = buffer[:, :, :, :1500]
    positions = 1480 + torch.arange(9, device="cuda")
    mask = torch.arange(1500, device="cuda")[None, :] <= positions[:, None]
    got = rows_attention(q, k, v, mask, 256 ** -0.5)  # the default on CUDA: tensor cores
    fp32_form = rows_attention(q, k, v, mask, 256 ** -0.5, tensor_cores=False)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=256 ** -0.5, enable_gqa=True)
    assert rel_err(got, want) < 1e-2  # (BF16 output: ~3e-3)
    assert rel_err(got, fp32_form) < 1e-2
