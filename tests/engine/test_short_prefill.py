"""Short prompts through a padded bucket (unimax.short_prefill): the same first token, logits
and state as the eager prefill, fresh and on kept state, at lengths around every bucket edge,
on pure and hybrid models; whatever the padding holds never reaches the state. (Eager on the
CPU: the same code the CUDA graphs capture; tests/gpu/test_gpu_engine.py replays the graphs.)"""

import pytest
import torch

import unimax
from helpers import cache_states, rel_err
from unimax import build_engine
from unimax.short_prefill import ShortPrefill


@pytest.fixture(scope="module")
def model(pure_or_hybrid):
    return pure_or_hybrid


def engines(model, buckets=(4, 16, 32, 64)):
    plain = build_engine(model, decode="bf16", block_size=4)
    short = build_engine(model, decode="bf16", block_size=4)
    short.short_prefill = ShortPrefill(model, short.exact_cache, use_graphs=False,
                                       buckets=buckets)
    return plain, short


def same_state(a, b):
    for x, y in zip(cache_states(a), cache_states(b), strict=True):
        assert rel_err(x, y) < 1e-4
    assert a.seen_tokens == b.seen_tokens == int(a.position) == int(b.position)


def ids(length, seed, vocab):
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
@pytest.mark.parametrize("kept", [0, 21])
def test_short_prefill_equals_the_eager_prefill(model, kept):
    vocab = model.config.vocab_size
    plain, short = engines(model)
    for length in (1, 3, 4, 5, 15, 16, 17, 31, 33, 64):
        x = ids(length, length, vocab)
        if kept:
            history = ids(kept, 99, vocab)
            plain.prefill_exact(history)
            short.prefill_exact(history)  # 21 tokens: itself a short prefill (bucket 32)
        first_a, out_a, _ = plain.prefill_exact(x, keep_state=bool(kept))
        first_b, out_b, _ = short.prefill_exact(x, keep_state=bool(kept))
        assert torch.equal(first_a, first_b), length
        assert rel_err(out_b.logits[:, -1], out_a.logits[:, -1]) < 1e-4
        same_state(short.exact_cache, plain.exact_cache)
    # a reply after it is the exact greedy one
    x = ids(10, 5, vocab)
    assert short.generate(x, 12, mode="verified").tokens == \
        unimax.exact_greedy_tokens(model, x, 12)[0].tolist()


@torch.inference_mode()
def test_padding_never_reaches_the_state(model):
    vocab = model.config.vocab_size
    _, short = engines(model)
    prefill = short.short_prefill
    x = ids(9, 1, vocab)  # bucket 16: 7 padded positions
    results = []
    for pad in (0, vocab - 1, 7):
        short.exact_cache.reset()
        prefill.inputs.fill_(pad)
        prefill.inputs[:, :9].copy_(x)
        prefill.length.fill_(9)
        prefill._run(16, short.exact_cache.window_for(16))
        results.append(([t.clone() for t in cache_states(short.exact_cache)],
                        prefill.logits.clone(), int(short.exact_cache.position)))
    for got in results[1:]:
        assert got[2] == results[0][2] == 9
        assert torch.equal(got[1], results[0][1])
        for a, b in zip(got[0], results[0][0], strict=True):
            assert torch.equal(a, b)


def test_long_and_overflowing_prompts_take_the_chunked_path(model):
    _, short = engines(model)
    assert short.short_prefill.bucket(64) == 64 and short.short_prefill.bucket(65) is None
    if short.exact_cache.has_attention:  # the padded KV must fit the buffers
        short.exact_cache.seen_tokens = short.exact_cache.max_kv_length - 10
        assert short.short_prefill.bucket(9) is None
        short.exact_cache.seen_tokens = 0
    with pytest.raises(ValueError, match="token id 999999"):
        short.prefill_exact(torch.tensor([[1, 999999]]))


@torch.inference_mode()
def test_capture_warm_up_runs_on_valid_buffers(model, monkeypatch):
    """Capture's warm-up (graph.GraphRunner.capture) runs each bucket's body on the static
    buffers as they are: before any prompt, and after a prompt of the largest bucket (the
    app's warm-up captures again later). A length out of a bucket's range selected a row past
    it: a device-side assert that took down the whole CUDA context on the H200. Here the bodies
    run eagerly (as the warm-up does), where a bad index raises."""
    engine = build_engine(model, decode="bf16", block_size=4)
    prefill = ShortPrefill(model, engine.exact_cache, use_graphs=False, buckets=(4, 16))
    ran = []

    def warm_up(key, fn, writes, buffers=()):  # what capture runs before recording the graph
        fn()
        ran.append(key)

    monkeypatch.setattr(prefill.runner, "prepare", warm_up)
    prefill.capture()
    first = len(ran)
    prefill(ids(16, 3, model.config.vocab_size))  # the largest bucket: the length says 16
    prefill.capture()
    assert {key[1] for key in ran} == {4, 16} and len(ran) == 2 * first


def warm_ups_only(ran: list):
    """GraphRunner.prepare as capture runs it, minus the CUDA graph: the real warm-up runs of
    the body inside the real trial_run (caches and buffers saved and restored), eagerly, where
    a write past the KV buffers raises."""
    from unimax.graph import trial_run, warm_up

    def prepare(self, key, fn, writes, buffers=()):
        with trial_run(writes, buffers):
            warm_up(fn, writes)
        ran.append(key)

    return prepare


@torch.inference_mode()
def test_capture_of_a_bucket_as_long_as_the_context(pure_or_hybrid, monkeypatch):
    """A bucket of max_context tokens (the 0.8B bench shape: buffers of 4096, the largest
    bucket 4096): each of capture's warm-up runs starts at position 0. The second used to start
    where the first left it (position 1) and wrote one KV entry past the buffers: a
    device-side assert on the H200."""
    from unimax.graph import GraphRunner

    model = pure_or_hybrid
    context = model.config.max_context
    engine = build_engine(model, decode="bf16", block_size=4)
    prefill = ShortPrefill(model, engine.exact_cache, use_graphs=False, buckets=(4, context))
    ran = []
    monkeypatch.setattr(GraphRunner, "prepare", warm_ups_only(ran))
    prefill.capture()
    assert ("prefill", context) in {key[:2] for key in ran}
    assert int(engine.exact_cache.position) == engine.exact_cache.seen_tokens == 0


@torch.inference_mode()
def test_capture_graphs_near_the_context_end(pure_or_hybrid, monkeypatch):
    """The engine's capture_graphs on a kept state a few tokens short of the context's end (an
    app that captures again after long use): every graph body's warm-up runs, every bucket
    included, and the caches are left exactly as they were."""
    from unimax.graph import GraphRunner

    model = pure_or_hybrid
    engine = build_engine(model, decode="fp8", block_size=4)
    engine.short_prefill = ShortPrefill(model, engine.exact_cache, use_graphs=False,
                                        buckets=(4, 16, 64))
    ran = []
    monkeypatch.setattr(GraphRunner, "prepare", warm_ups_only(ran))
    engine.prefill_exact(ids(20, 5, model.config.vocab_size))
    near = model.config.max_context - 3
    for cache in (engine.exact_cache, engine.decode_graph.cache):
        cache.position.fill_(near)
        cache.seen_tokens = near
    before = [s.clone() for s in cache_states(engine.exact_cache)]
    engine.capture_graphs(verified=True, sampled=True)
    assert any(key[0] == "verify" for key in ran)
    assert {key[1] for key in ran if key[0] == "prefill"} == {4, 16, 64}
    for cache in (engine.exact_cache, engine.decode_graph.cache):
        assert int(cache.position) == cache.seen_tokens == near
    for a, b in zip(before, cache_states(engine.exact_cache), strict=True):
        assert torch.equal(a, b)
