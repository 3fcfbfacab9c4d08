"""One token's attention over a static KV buffer (unimax.ops.decode_attention): the split-KV
kernels in Triton's interpreter against torch's SDPA over the whole buffer under the position's
mask (a reference we did not write, and what the graphs ran before); the op's twin, its
arguments' errors and the attention layer's dispatch on the CPU."""

import pytest
import torch

from helpers import kernels_for_test, run_with_triton
from unimax.ops.decode_attention import (
    check_args,
    decode_attention,
    decode_attention_ref,
    splits_for,
    supported,
)

CHILD = r"""
import torch
import torch.nn.functional as F
from unimax.ops.decode_attention import launch

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

torch.manual_seed(0)
# (B, H, KVH, L, D, T): grouped query heads (4 and 2 a KV head), one a KV head, a batch of
# two; one token (q (B, H, D)) and blocks of tokens (q (B, H, T, D), causal among themselves)
for b, h, kvh, length, d, tokens in [(1, 8, 2, 70, 32, 1), (1, 4, 2, 40, 16, 1),
                                     (2, 2, 2, 33, 64, 1), (1, 6, 6, 20, 16, 1),
                                     (1, 8, 2, 70, 32, 9), (2, 4, 2, 40, 16, 3),
                                     (1, 6, 6, 45, 16, 5)]:
    for dtype in (torch.float32, torch.bfloat16):
        # the caches as the layer holds them: views of (B, L, KVH, D) buffers, keys strided
        k = torch.randn(b, length, kvh, d).to(dtype).transpose(1, 2)
        v = torch.randn(b, kvh, length, d).to(dtype)
        # strided heads; a block's q as the layer's transposed view of (B, T, H, D)
        q = (torch.randn(b, h, 3, d).to(dtype)[:, :, 1] if tokens == 1 else
             torch.randn(b, tokens, h, d).to(dtype).transpose(1, 2))
        q4 = q[:, :, None] if tokens == 1 else q
        for pos in (0, 1, 17, length - tokens, length + 5):  # past the buffer: all of it
            position = torch.tensor([pos])
            keys = torch.arange(length)
            mask = keys[None, :] <= pos + torch.arange(tokens)[:, None]
            ref = F.scaled_dot_product_attention(
                q4.float(), k.float(), v.float(), attn_mask=mask, scale=d ** -0.5,
                enable_gqa=h != kvh)
            ref = ref[:, :, 0] if tokens == 1 else ref
            # launch settings, the last two with fewer rows a program than the block has
            for block_n, splits, rows in ((16, 4, 64), (16, 1, 64), (32, 2, 64), (16, 4, 16),
                                          (16, 2, 32)):
                out = launch(q, k, v, position, d ** -0.5, block_n, splits, rows=rows)
                assert out.dtype == dtype and out.shape == q.shape
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                err = rel(out, ref)
                assert err < tol, (b, h, kvh, length, d, tokens, dtype, pos, block_n, splits,
                                   rows, err)
        print("ok", b, h, kvh, length, d, tokens, dtype)
"""


def test_kernels_match_sdpa_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("ok") == 14, out


def test_twin_is_masked_sdpa_and_a_softmax_by_hand():
    """The op off CUDA is its twin; both equal a softmax over the keys at or below the
    position computed by hand in float64 (grouped heads: query head h reads KV head h // g)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=gen)
    k, v = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    position = torch.tensor([5])
    out = decode_attention(q, k, v, position, 0.25)
    assert torch.equal(out, decode_attention_ref(q, k, v, position, 0.25))
    kk = k.double().repeat_interleave(2, 1)[:, :, :6]
    vv = v.double().repeat_interleave(2, 1)[:, :, :6]
    by_hand = torch.einsum("bhn,bhnd->bhd", torch.softmax(
        torch.einsum("bhd,bhnd->bhn", q.double(), kk) * 0.25, -1), vv)
    assert torch.allclose(out.double(), by_hand, atol=1e-6)


def test_bad_arguments_name_the_problem():
    q, k = torch.randn(1, 4, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="H a multiple of KVH"):
        check_args(torch.randn(1, 3, 16), k, k, torch.tensor([0]))
    with pytest.raises(ValueError, match="H a multiple of KVH"):
        check_args(q, k, torch.randn(1, 2, 9, 16), torch.tensor([0]))
    with pytest.raises(ValueError, match="in q's dtype"):
        check_args(q, k.bfloat16(), k.bfloat16(), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer tensor"):
        check_args(q, k, k, torch.tensor([0.0]))
    assert supported(q, k, k) and not supported(torch.randn(1, 4, 24), k, k)
    assert not supported(q, k.bfloat16(), k)


def test_splits_stay_a_power_of_two_within_the_buffer_and_one_wave():
    assert splits_for(1, 4, 8192) == 32
    assert splits_for(1, 2, 8192) == 64  # PROGRAMS // 2
    assert splits_for(8, 4, 8192) == 4
    assert splits_for(1, 4, 100) == 4  # 4 blocks of 32
    assert splits_for(1, 4, 90) == 2  # 3 blocks: the power of two below
    assert splits_for(64, 4, 8192) == 1


def spied_hybrid(monkeypatch, record):
    """A tiny hybrid (GDN and attention layers alternating, 4 query heads on 2 KV heads of 16)
    whose attention layers' op calls are recorded: ``record(args)`` for each, in a list."""
    import dataclasses

    from unimax import GDNForCausalLM, attention
    from unimax.tiny import TINY_CONFIG

    config = dataclasses.replace(
        TINY_CONFIG, layer_types=("linear_attention", "full_attention") * 2,
        num_attention_heads=4, num_key_value_heads=2, attn_head_dim=16, max_context=48)
    calls = []

    def spy(*args):
        calls.append(record(args))
        return decode_attention(*args)

    monkeypatch.setattr(attention, "decode_attention", spy)
    return GDNForCausalLM.random(config, seed=1), calls


def test_a_graphs_one_token_step_goes_through_the_op(monkeypatch):
    """A hybrid model's one-token forward over the static buffer (forward_unchecked: what the
    graphs capture) calls the op with the cache's position and agrees with the eager step,
    which reads exactly the stored entries without it; the eager step and a multi-token
    forward never call it."""

    model, calls = spied_hybrid(monkeypatch, lambda args: int(args[3].reshape(-1)[0]))
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    eager_cache, graph_cache, sdpa_cache = (model.make_recurrent_cache() for _ in range(3))
    with torch.no_grad():
        for cache in (eager_cache, graph_cache, sdpa_cache):
            model(input_ids=ids[:, :11], past_key_values=cache)
        eager = model(input_ids=ids[:, 11:], past_key_values=eager_cache).logits
        assert calls == []
        graph = model.forward_unchecked(ids[:, 11:], graph_cache)
        assert calls == [11, 11]  # both attention layers, at 11 stored entries
        kernels_for_test(monkeypatch, decode_attention_tokens=0)
        sdpa = model.forward_unchecked(ids[:, 11:], sdpa_cache)
    assert len(calls) == 2
    assert torch.allclose(graph, eager, atol=1e-5) and torch.equal(graph, sdpa)
    # in default grad mode (autograd recording: the op has no backward) it keeps SDPA
    kernels_for_test(monkeypatch, decode_attention_tokens=17)
    grad_cache = model.make_recurrent_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :11], past_key_values=grad_cache)
    logits = model.forward_unchecked(ids[:, 11:], grad_cache)
    logits.sum().backward()
    assert len(calls) == 2 and torch.allclose(logits.detach(), graph, atol=1e-6)



def test_twin_of_a_block_is_causal_among_its_tokens():
    """q (B, H, T, D): token t sees the keys 0..position + t (a float64 softmax by hand); the
    output has q's shape in (B, T, H, D) memory, as the fake kernel says, so the layer's
    transpose back is a view."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 4, 16, generator=gen).transpose(1, 2)  # (B, H=4, T=3, D)
    k, v = torch.randn(1, 2, 12, 16, generator=gen), torch.randn(1, 2, 12, 16, generator=gen)
    out = decode_attention(q, k, v, torch.tensor([6, 7, 8]), 0.25)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    for t in range(3):
        visible = 6 + t + 1
        by_hand = torch.einsum("bhn,bhnd->bhd", torch.softmax(torch.einsum(
            "bhd,bhnd->bhn", q[:, :, t].double(), kk[:, :, :visible]) * 0.25, -1),
            vv[:, :, :visible])
        assert torch.allclose(out[:, :, t].double(), by_hand, atol=1e-6), t
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = decode_attention(*(mode.from_tensor(x) for x in (q, k, v, torch.tensor([6]))),
                                0.25)
    assert fake.shape == out.shape and fake.stride() == out.stride()


def test_a_graphs_block_goes_through_the_op_up_to_its_token_limit(monkeypatch):
    """With the kernel configuration's decode_attention_tokens at 9, a hybrid's 5-token forward
    over the static buffer (the verifier's block as its graphs capture it) calls the op once per
    attention layer at the cache's position and equals rows_attention's result under the mask (the
    path it replaces), eager and compiled by inductor (the fake kernel's layout); at the default,
    one token, it keeps rows_attention."""

    model, calls = spied_hybrid(
        monkeypatch, lambda args: (int(args[3].reshape(-1)[0]), args[0].shape[2]))
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(6))

    def block(tokens_limit: int, compiled: bool = False) -> torch.Tensor:
        kernels_for_test(monkeypatch, decode_attention_tokens=tokens_limit)
        cache = model.make_recurrent_cache()
        with torch.no_grad():
            model(input_ids=ids[:, :11], past_key_values=cache)
            forward = torch.compile(model.forward_unchecked, backend="inductor",
                                    fullgraph=True) if compiled else model.forward_unchecked
            return forward(ids[:, 11:], cache)

    rows = block(1)
    assert calls == []
    kernel = block(9)
    assert calls == [(11, 5), (11, 5)]
    assert torch.allclose(kernel, rows, atol=1e-5)
    torch._dynamo.reset()
    compiled = block(9, compiled=True)
    assert torch.allclose(compiled, kernel, atol=1e-5)
