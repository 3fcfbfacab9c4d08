"""Public entry points in default grad mode, as a transformers user calls a model: no
torch.no_grad() or inference_mode around them. The cache is state, never part of an autograd
graph; the logits keep their graph; the numbers equal the inference-mode ones."""

import pytest
import torch

import unimax
from helpers import write_qwen_checkpoint
from unimax import GDNForCausalLM, build_engine
from unimax.tiny import TINY_CONFIG


@pytest.fixture(scope="module", params=["pure", "hybrid"])
def model(request, tmp_path_factory):
    if request.param == "pure":
        return GDNForCausalLM.random(TINY_CONFIG, seed=0)
    path = tmp_path_factory.mktemp("hybrid")
    write_qwen_checkpoint(path, seed=5, num_layers=4,
                          layer_types=["linear_attention"] * 3 + ["full_attention"])
    return unimax.load_model(path, device="cpu", dtype="float32", max_context=128)


def ids(model, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, length), generator=gen)


def test_forward_with_cache_in_grad_mode(model):
    assert torch.is_grad_enabled()
    prompt = ids(model, 9)
    cache = model.make_recurrent_cache()
    first = model(input_ids=prompt[:, :6], past_key_values=cache, use_cache=True)
    step = model(input_ids=prompt[:, 6:], past_key_values=cache, use_cache=True)
    assert first.logits.requires_grad and step.logits.requires_grad
    assert not any(t.requires_grad for layer in cache.layers
                   for t in getattr(layer, "recurrent_states", {}).values())
    step.logits.sum().backward()  # the logits' graph is usable; the cache is not in it
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)

    with torch.inference_mode():
        ref_cache = model.make_recurrent_cache()
        model(input_ids=prompt[:, :6], past_key_values=ref_cache, use_cache=True)
        ref = model(input_ids=prompt[:, 6:], past_key_values=ref_cache, use_cache=True)
    torch.testing.assert_close(step.logits.detach(), ref.logits, rtol=0, atol=0)
    assert cache.seen_tokens == ref_cache.seen_tokens == 9
    # use_cache=True without a cache makes one, as transformers does
    out = model(input_ids=prompt, use_cache=True)
    assert out.past_key_values.seen_tokens == 9


def test_engine_and_reference_in_grad_mode(model):
    prompt = ids(model, 12, seed=1)
    reference = unimax.exact_greedy_tokens(model, prompt, 10)
    cache = model.make_recurrent_cache()
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    token = model.greedy_step(prompt[:, -1:], cache)
    assert token.shape == (1, 1)
    engine = build_engine(model, decode="fp8", block_size=4)
    got, report = engine.generate_verified(prompt, 10)
    assert torch.equal(got, reference) and report.generated_tokens == 10
    assert engine.generate(prompt, 10, mode="fast").tokens == reference[0].tolist()
    snapshot = unimax.snapshot_cache(cache)
    unimax.restore_cache_(cache, snapshot)
    unimax.copy_cache_(engine.exact_cache, cache)
