"""GPU (run on the lent H200: pytest -m gpu): one token's attention over a static KV buffer
(unimax.ops.decode_attention) at Qwen3.5-0.8B's and -4B's heads against torch's SDPA over the
whole buffer under the position's mask (what the graphs ran before), at every launch setting
bench/decode_attention.py times; the op captured in a CUDA graph replays what it computes
eagerly as the position moves; the same for the verifier's blocks of tokens; and a hybrid
model's one-token forward and 9-token block agree with the paths the op replaced."""

import dataclasses

import pytest
import torch

from helpers import kernels_for_test, rel_err
from unimax.ops import decode_attention as attn

pytestmark = pytest.mark.gpu

SETTINGS = ((16, 16, 4), (32, 32, 4), (32, 16, 4), (64, 16, 8), (32, 64, 4))


@torch.inference_mode()
def test_decode_attention_matches_sdpa_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    for heads, kv_heads, buffer in ((8, 2, 4096), (16, 4, 8192)):
        k = torch.randn(1, kv_heads, buffer, 256, device="cuda", generator=gen).bfloat16()
        v = torch.randn_like(k)
        q = torch.randn(1, heads, 256, device="cuda", generator=gen).bfloat16()
        for pos in (0, 1, 511, 4095, buffer - 1):
            position = torch.tensor([pos], device="cuda")
            ref = attn.decode_attention_ref(q, k, v, position, 256 ** -0.5)
            for block_n, splits, warps in SETTINGS:
                out = attn.launch(q, k, v, position, 256 ** -0.5, block_n, splits, warps)
                assert rel_err(out, ref) < 1e-2, (heads, pos, block_n, splits, warps)
            assert torch.equal(attn.decode_attention(q, k, v, position, 256 ** -0.5),
                               attn.launch(q, k, v, position, 256 ** -0.5))


def assert_replay_follows_the_position(q, k, v, positions, gen=None) -> None:
    """decode_attention captured once at position 0: replayed at each of ``positions`` (with a
    fresh q from ``gen`` where given) it equals an eager call bit for bit."""
    position = torch.tensor([0], device="cuda")
    attn.decode_attention(q, k, v, position, 0.0625)  # (compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.decode_attention(q, k, v, position, 0.0625)
    for pos in positions:
        position.fill_(pos)
        if gen is not None:
            q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        graph.replay()
        assert torch.equal(out, attn.decode_attention(q, k, v, position, 0.0625)), pos


@torch.inference_mode()
def test_decode_attention_in_a_graph_follows_the_position_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(4)
    k = torch.randn(1, 4, 8192, 256, device="cuda", generator=gen).bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(1, 16, 256, device="cuda", generator=gen).bfloat16()
    assert_replay_follows_the_position(q, k, v, (7, 700, 8191, 3), gen)


@torch.inference_mode()
def test_decode_attention_of_a_block_matches_sdpa_and_replays_on_gpu():
    """The verifier's blocks (9 and 17 tokens, causal among themselves) at both heads against
    the twin, at each rows-a-program setting; captured, the replay follows the position."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for heads, kv_heads, buffer in ((8, 2, 4096), (16, 4, 8192)):
        k = torch.randn(1, kv_heads, buffer, 256, device="cuda", generator=gen).bfloat16()
        v = torch.randn_like(k)
        for tokens in (9, 17):
            q = torch.randn(1, tokens, heads, 256, device="cuda",
                            generator=gen).bfloat16().transpose(1, 2)
            for pos in (0, 5, 511, 4000, buffer - tokens):
                position = torch.tensor([pos], device="cuda")
                ref = attn.decode_attention_ref(q, k, v, position, 256 ** -0.5)
                for rows in (16, 32, 64):
                    out = attn.launch(q, k, v, position, 256 ** -0.5, rows=rows)
                    assert rel_err(out, ref) < 1e-2, (heads, tokens, pos, rows)
    assert_replay_follows_the_position(q, k, v, (7, 700, 8000, 3))


@torch.inference_mode()
def test_hybrid_one_token_forward_agrees_with_sdpa_on_gpu(monkeypatch):
    """A Qwen3.5-shaped hybrid (tiny widths, real head sizes) in BF16: the one-token forward
    over the static buffer through the op, against the same forward through SDPA, from the
    same prefilled state."""
    from unimax import GDNForCausalLM
    from unimax.tiny import TINY_CONFIG

    config = dataclasses.replace(
        TINY_CONFIG, layer_types=("linear_attention", "full_attention") * 2,
        num_attention_heads=8, num_key_value_heads=2, attn_head_dim=256, max_context=2048,
        partial_rotary_factor=0.25)
    model = GDNForCausalLM.random(config, device="cuda", dtype=torch.bfloat16, seed=2)
    ids = torch.randint(0, config.vocab_size, (1, 300), device="cuda")
    outs = []
    for kernel in (True, False):
        kernels_for_test(monkeypatch, decode_attention_tokens=17 if kernel else 0)
        cache = model.make_recurrent_cache()
        model(input_ids=ids[:, :299], past_key_values=cache)
        outs.append(model.forward_unchecked(ids[:, 299:], cache).float())
    assert rel_err(outs[0], outs[1]) < 1e-2
    # a verifier's block of 9 (the op's block form against rows_attention over the buffer)
    kernels_for_test(monkeypatch, decode_attention_tokens=17)
    blocks = []
    for tokens_limit in (17, 1):
        kernels_for_test(monkeypatch, decode_attention_tokens=tokens_limit)
        cache = model.make_recurrent_cache()
        model(input_ids=ids[:, :291], past_key_values=cache)
        blocks.append(model.forward_unchecked(ids[:, 291:], cache).float())
    assert rel_err(blocks[0], blocks[1]) < 1e-2
