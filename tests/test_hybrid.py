"""Hybrid Qwen3.5 models (GDN layers with gated attention every few layers) against
transformers' own Qwen3_5ForCausalLM, and the static KV cache."""

import pytest
import torch
from helpers import rel_err, write_qwen_checkpoint

import unimax

HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    reference = write_qwen_checkpoint(path, seed=5, num_layers=4, layer_types=HYBRID, tie=True)
    return path, reference


def ids(length, seed=0):
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


def test_full_forward_matches_transformers(checkpoint):
    path, reference = checkpoint
    model = unimax.load_model(path, dtype="float32", max_context=256)
    assert model.config.has_attention and model.config.is_attention(3)
    x = ids(70)
    with torch.no_grad():
        assert rel_err(model(input_ids=x).logits,
                       reference(input_ids=x, use_cache=False).logits) < 1e-4


def test_prefill_then_steps_through_the_kv_cache(checkpoint):
    path, reference = checkpoint
    model = unimax.load_model(path, dtype="float32", max_context=128)
    x = ids(90, seed=1)
    with torch.no_grad():
        expected = reference(input_ids=x, use_cache=False).logits
        cache = model.make_recurrent_cache()
        parts = [model(input_ids=x[:, :50], past_key_values=cache).logits]
        for t in range(50, 60):
            parts.append(model(input_ids=x[:, t:t + 1], past_key_values=cache).logits)
        parts.append(model(input_ids=x[:, 60:], past_key_values=cache).logits)
    assert rel_err(torch.cat(parts, dim=1), expected) < 1e-4
    assert int(cache.position) == cache.seen_tokens == 90


def test_transformers_cache_agrees_too(checkpoint):
    """transformers' own cached generation (hybrid configs can use its cache) gives the same
    greedy tokens as our exact reference."""
    path, reference = checkpoint
    model = unimax.load_model(path, dtype="float32", max_context=128)
    x = ids(20, seed=2)
    with torch.no_grad():
        theirs = reference.generate(x, max_new_tokens=12, do_sample=False)[:, 20:]
    assert torch.equal(unimax.exact_greedy_tokens(model, x, 12), theirs)


def test_rollback_by_position_hides_stale_entries(checkpoint):
    path, _ = checkpoint
    model = unimax.load_model(path, dtype="float32", max_context=64)
    x, other = ids(30, seed=3), ids(10, seed=4)
    with torch.no_grad():
        cache = model.make_recurrent_cache()
        model(input_ids=x[:, :20], past_key_values=cache)
        snapshot = unimax.snapshot_cache(cache, out=cache.empty_like(share_kv=True))
        model(input_ids=other, past_key_values=cache)  # writes KV at 20..29, then rolled back
        unimax.restore_cache_(cache, snapshot)
        got = model(input_ids=x[:, 20:], past_key_values=cache).logits
        expected = model(input_ids=x).logits[:, 20:]
    assert rel_err(got, expected) < 1e-5


def test_context_limit_is_a_clear_error(checkpoint):
    path, _ = checkpoint
    model = unimax.load_model(path, dtype="float32", max_context=32)
    cache = model.make_recurrent_cache()
    with torch.no_grad():
        model(input_ids=ids(30), past_key_values=cache)
        with pytest.raises(ValueError, match="would reach 33 tokens, over this model's context "
                                             "of 32"):
            model(input_ids=ids(3), past_key_values=cache)
