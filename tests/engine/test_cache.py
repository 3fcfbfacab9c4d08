"""Cached prefill + steps equal one full forward; snapshot/restore/copy are bit-exact."""

import pytest
import torch

import unimax
from helpers import rel_err
from unimax import GDNConfig, GDNForCausalLM
from unimax.cache import cache_payload_bytes, copy_cache_, restore_cache_, snapshot_cache

CONFIG = dict(vocab_size=89, hidden_size=48, num_hidden_layers=3, num_k_heads=2, num_v_heads=4,
              head_k_dim=16, head_v_dim=8, intermediate_size=80)


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["fla-norms", "qwen-norms"])
def model(request):
    m = GDNForCausalLM(GDNConfig(**CONFIG, norm_offset=request.param)).eval()
    m.init_random_weights(seed=7, std=0.08)
    return m


def tokens(length, seed=0, batch=1):
    return torch.randint(0, 89, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_then_steps_equals_full_forward(model):
    x = tokens(100, batch=2)
    full = model(input_ids=x).logits
    cache = model.make_recurrent_cache(batch_size=2)
    parts = [model(input_ids=x[:, :70], past_key_values=cache, use_cache=True).logits]
    for t in range(70, 100):
        parts.append(model(input_ids=x[:, t:t + 1], past_key_values=cache).logits)
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5
    assert cache.seen_tokens == 100


@torch.no_grad()
def test_multi_token_continuations_equal_full_forward(model):
    x = tokens(150, seed=1)
    full = model(input_ids=x).logits
    cache = model.make_recurrent_cache()
    parts, start = [], 0
    for size in (1, 7, 64, 3, 70, 5):  # odd sizes cross the 64-token chunk boundaries
        chunk = x[:, start:start + size]
        parts.append(model(input_ids=chunk, past_key_values=cache, use_cache=True).logits)
        start += size
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-5


@torch.no_grad()
def test_logits_to_keep(model):
    x = tokens(20, seed=2)
    full = model(input_ids=x).logits
    kept = model(input_ids=x, logits_to_keep=3).logits
    assert kept.shape == (1, 3, 89)
    assert rel_err(kept, full[:, -3:]) < 1e-6
    out = model(input_ids=x, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.seen_tokens == 20


@torch.no_grad()
def test_greedy_reference_matches_argmax_of_full_forwards(model):
    x = tokens(12, seed=3)
    generated = unimax.exact_greedy_tokens(model, x, 6)
    seq = x
    for i in range(6):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        assert int(nxt) == int(generated[0, i])
        seq = torch.cat([seq, nxt], dim=1)
    assert unimax.exact_greedy_tokens(model, x, 0).shape == (1, 0)


@torch.no_grad()
def test_snapshot_restore_is_bit_exact(model):
    x = tokens(40, seed=4)
    cache = model.make_recurrent_cache()
    model(input_ids=x[:, :30], past_key_values=cache)
    snap = snapshot_cache(cache)
    first = model(input_ids=x[:, 30:], past_key_values=cache).logits
    state_after = snapshot_cache(cache)
    restore_cache_(cache, snap)
    assert cache.seen_tokens == 30
    again = model(input_ids=x[:, 30:], past_key_values=cache).logits
    assert torch.equal(first, again)
    for a, b in zip(cache.layers, state_after.layers, strict=True):
        assert torch.equal(a.recurrent_states[0], b.recurrent_states[0])
        assert torch.equal(a.conv_states[0], b.conv_states[0])


@torch.no_grad()
def test_snapshot_into_preallocated_buffers_and_copy_keeps_addresses(model):
    cache = model.make_recurrent_cache()
    model(input_ids=tokens(9), past_key_values=cache)
    buffers = cache.empty_like()
    ptrs = [layer.recurrent_states[0].data_ptr() for layer in buffers.layers]
    out = snapshot_cache(cache, out=buffers)
    assert out is buffers
    assert [layer.recurrent_states[0].data_ptr() for layer in buffers.layers] == ptrs
    dst = model.make_recurrent_cache()
    dst_ptrs = [(layer.conv_states[0].data_ptr(), layer.recurrent_states[0].data_ptr())
                for layer in dst.layers]
    copy_cache_(dst, cache)
    assert [(layer.conv_states[0].data_ptr(), layer.recurrent_states[0].data_ptr())
            for layer in dst.layers] == dst_ptrs
    assert dst.seen_tokens == 9 and dst.layers[0].has_previous_state[0]
    assert all(torch.equal(a.recurrent_states[0], b.recurrent_states[0])
               for a, b in zip(dst.layers, cache.layers, strict=True))


@torch.no_grad()
def test_forward_updates_cache_in_place(model):
    cache = model.make_recurrent_cache()
    ptrs = [(layer.conv_states[0].data_ptr(), layer.recurrent_states[0].data_ptr())
            for layer in cache.layers]
    model(input_ids=tokens(70), past_key_values=cache)
    model(input_ids=tokens(1), past_key_values=cache)
    assert [(layer.conv_states[0].data_ptr(), layer.recurrent_states[0].data_ptr())
            for layer in cache.layers] == ptrs


@torch.no_grad()
def test_payload_bytes_do_not_grow_with_context(model):
    short, long = model.make_recurrent_cache(), model.make_recurrent_cache()
    model(input_ids=tokens(5), past_key_values=short)
    model(input_ids=tokens(600), past_key_values=long)
    cfg = model.config
    per_layer = cfg.conv_dim * cfg.conv_size * 4 + cfg.num_v_heads * cfg.head_k_dim * \
        cfg.head_v_dim * 4
    assert cache_payload_bytes(short) == cache_payload_bytes(long) == 3 * per_layer


def test_reset_zeroes_state(model):
    cache = model.make_recurrent_cache()
    with torch.no_grad():
        model(input_ids=tokens(8), past_key_values=cache)
    cache.reset()
    assert cache.seen_tokens == 0
    assert all(not layer.recurrent_states[0].any() and not layer.has_previous_state[0]
               for layer in cache.layers)


def test_copy_mismatches_name_the_table(model):
    cache = model.make_recurrent_cache()
    other = GDNForCausalLM(GDNConfig(**{**CONFIG, "head_v_dim": 16})).make_recurrent_cache()
    with pytest.raises(RuntimeError, match=r"layer 0 conv_states\[0\]"):
        copy_cache_(other, cache)
    fewer = GDNForCausalLM(GDNConfig(**{**CONFIG, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="destination has 2 layers, source has 3"):
        copy_cache_(fewer.make_recurrent_cache(), cache)


def test_states_are_views_of_two_flat_buffers(model):
    """A bridge or snapshot moves two buffers, whatever the number of layers."""
    from unimax.cache import state_tensors

    cache = model.make_recurrent_cache()
    for layer in cache.layers:
        for table, buffer in (("conv_states", cache.conv_buffer),
                              ("recurrent_states", cache.recurrent_buffer)):
            tensor = getattr(layer, table)[0]
            assert tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert len(state_tensors(cache)) == 3
    assert cache_payload_bytes(cache) == (cache.conv_buffer.numel() * 4 +
                                          cache.recurrent_buffer.numel() * 4)
