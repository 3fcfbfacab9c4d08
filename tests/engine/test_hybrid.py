"""Hybrid Qwen3.5 models (GDN layers with gated attention every few layers) against
transformers' own Qwen3_5ForCausalLM, and the static KV cache."""

import types

import pytest
import torch

import unimax
from helpers import kernels_for_test, rel_err, verifier_launches, write_qwen_checkpoint
from unimax import kernels

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


@pytest.fixture(scope="module")
def hybrid_model(checkpoint):
    return unimax.load_model(checkpoint[0], dtype="float32", max_context=256)


@pytest.mark.parametrize("block", [1, 3, 8])
def test_verified_on_hybrid_rolls_kv_back(hybrid_model, block):
    from test_engine import erring_engine

    x = ids(25, seed=block)
    expected = unimax.exact_greedy_tokens(hybrid_model, x, 30)
    engine = erring_engine(hybrid_model, block_size=8, period=3)
    assert engine.decode_graph.cache.layers[3].key_cache is engine.exact_cache.layers[3].key_cache
    got, report = engine.generate_verified(x, 30, draft_block=block)
    assert torch.equal(got, expected) and report.rejected_blocks > 0
    # the bridge moves the fixed-size state only, however long the prompt
    _, _, short = engine.prefill_exact(ids(5))
    _, _, long = engine.prefill_exact(ids(200))
    assert short.mib == long.mib


@pytest.mark.parametrize("block_size,block", [(8, 3), (8, 8), (16, 5), (16, 12)])
def test_verified_runs_to_the_last_slot_of_the_context(checkpoint, block_size, block,
                                                       monkeypatch):
    """A reply that fills the context to its last slot: short blocks pad their forward to
    their span block (block_size, or 8 drafts where block_size is 16) while the KV buffers have
    room and stop padding where they have none (the padding would write KV past the buffers),
    and the tokens stay exact greedy."""
    from test_engine import erring_engine

    model = unimax.load_model(checkpoint[0], dtype="float32", max_context=64)
    x = ids(20, seed=11)
    expected = unimax.exact_greedy_tokens(model, x, 44)
    engine = erring_engine(model, block_size=block_size, period=3)
    spans = verifier_launches(engine, monkeypatch,
                              lambda key: (key[1], key[2], engine.exact_cache.seen_tokens))
    got, report = engine.generate_verified(x, 44, draft_block=block)
    assert torch.equal(got, expected) and report.rejected_blocks > 0
    assert all(stored + span <= 64 for _, span, stored in spans)
    short = [(span, stored) for k, span, stored in spans if 0 < k < block_size]
    padded = (8 if block <= 8 else 16) + 1
    assert any(span == padded for span, _ in short)  # padded while there was room
    assert any(span < padded and stored + padded > 64 for span, stored in short)  # then not
    # every block of k drafts: its span block's rows (9 for k <= 8, 17 above), or unpadded
    assert all(span in ((9 if k <= 8 else 17), k + 1) for k, span, _ in spans if k)


@pytest.mark.parametrize("decode,draft", [("bf16", "tail"), ("fp8", "tail"), ("fp8", "full")])
def test_engines_on_hybrid(hybrid_model, decode, draft):
    x = ids(40, seed=7)
    expected = unimax.exact_greedy_tokens(hybrid_model, x, 20)
    engine = unimax.build_engine(hybrid_model, decode=decode, draft=draft, block_size=4)
    assert torch.equal(engine.generate_verified(x, 20)[0], expected)
    if decode == "bf16":
        assert torch.equal(engine.generate_fast(x, 20), expected)


@pytest.mark.parametrize("mode", ["fast", "verified"])
def test_hybrid_stop_and_next_turn(hybrid_model, mode):
    x = ids(15, seed=8)
    reference = unimax.exact_greedy_tokens(hybrid_model, x, 30)[0].tolist()
    engine = unimax.build_engine(hybrid_model, decode="bf16", block_size=8)
    first = engine.generate(x, 30, mode=mode, stop_ids=[reference[10]])
    assert first.tokens == reference[: reference.index(reference[10]) + 1]
    turn2 = ids(6, seed=9)
    second = engine.generate(turn2, 10, mode=mode, keep_state=True)
    history = torch.cat([x, torch.tensor([first.tokens]), turn2], dim=1)
    assert second.tokens == unimax.exact_greedy_tokens(hybrid_model, history, 10)[0].tolist()
    with pytest.raises(ValueError, match="over this model's context of 256"):
        engine.generate(ids(10), 250, mode=mode, keep_state=True)


def hybrid_service(path, letters: bool = True, **preset):
    """The app's service on a small hybrid checkpoint with tiny-random's byte tokenizer;
    ``letters``: its replies mostly letters (else varied bytes, compared as token ids)."""
    from unimax.presets import Preset
    from unimax.service import EngineService

    write_qwen_checkpoint(path, seed=6, num_layers=4, layer_types=HYBRID, vocab=259)
    model = unimax.load_model(path, dtype="float32", max_context=512)
    tokenizer = unimax.load_tokenizer("tiny-random")
    # Favour letters (as tiny-random does): a reply of random bytes would not survive the
    # text round trip, and the kept state is only reused for an exact token-prefix match.
    vocab = tokenizer.get_vocab()
    scale = torch.full((259, 1), 0.05)
    scale[[vocab[c] for c in "abcdefghijklmnopqrstuvwxyz\u0120"]] = 10.0
    if letters:
        with torch.no_grad():
            model.embed_tokens.weight.mul_(scale)
    return EngineService(Preset(model=str(path), max_context=512, **preset), model=model,
                         tokenizer=tokenizer).start()


def test_service_keeps_hybrid_conversations(tmp_path):
    from unimax.logprobs import LogprobsRequest
    from unimax.service import GenerationSettings

    service = hybrid_service(tmp_path)
    try:
        first = [{"role": "user", "content": "hello"}]
        settings = GenerationSettings(max_new_tokens=8)
        t1 = list(service.submit("h", first, "verified", settings).events(timeout=60))
        # between the turns, a log-probabilities request: it writes the KV buffers it borrows
        # from the engine (unimax/logprobs.py), over the kept conversation's positions
        scored = list(service.submit("other", [], "bf16", settings, text="zq " * 40,
                                     logprobs=LogprobsRequest(top=2, prompt=True))
                      .events(timeout=60))
        assert scored[-1].kind == "done" and scored[-1].data["stats"]["mode"] == "exact"
        second = first + [{"role": "assistant", "content": t1[-1].data["reply"]},
                          {"role": "user", "content": "again"}]
        for conversation in ("h", "fresh"):  # with the kept state, and from scratch
            events = list(service.submit(conversation, second, "bf16", settings)
                          .events(timeout=60))
            started = next(e for e in events if e.kind == "started").data
            assert (started["reused_tokens"] > 0) == (conversation == "h")
            if conversation == "h":
                kept = events[-1].data["reply"]
            else:
                assert events[-1].data["reply"] == kept
    finally:
        service.stop()


def test_modes_share_one_exact_side_and_a_race_swaps_it(tmp_path):
    """Every mode's engine prefills, verifies and finishes on one exact side (one cache, one
    set of KV buffers, one FP8 LM head); replies racing side by side (the page's A/B) each
    park their exact state and KV at every turn, so each reply is what it is alone, on the
    same conversation (same prompt, replies apart) and on two different ones, and the state
    each keeps for its next turn is its own."""
    from unimax.service import GenerationSettings

    service = hybrid_service(tmp_path, letters=False, block_size=4, draft="full")
    try:
        settings = GenerationSettings(max_new_tokens=40)
        talk = [[{"role": "user", "content": "hello there"}],
                [{"role": "user", "content": "something else entirely, longer"}]]

        def last(handle):
            return list(handle.events(timeout=120))[-1]

        alone = {(mode, n): last(service.submit(f"alone-{mode}-{n}", talk[n], mode,
                                                settings)).data["tokens"]
                 for mode in ("fp8", "verified") for n in (0, 1)}
        for mode in ("fp8", "verified"):  # (the two conversations' replies apart, or no test)
            assert alone[(mode, 0)] != alone[(mode, 1)]
        engines = [service._engine(mode) for mode in ("bf16", "fp8", "verified")]
        exact = service.exact
        assert all(e.exact is exact and e.exact_cache is exact.cache for e in engines)
        kv = {t.data_ptr() for e in engines for t in unimax.cache.kv_tensors(
            e.decode_graph.cache)}
        assert kv == {t.data_ptr() for t in unimax.cache.kv_tensors(exact.cache)}
        assert engines[1].decode_model.lm_head is engines[2].decode_model.lm_head
        assert engines[0]._verifier is engines[1]._verifier is None  # fast modes: none built
        for first, second in ((0, 0), (0, 1), (1, 0)):
            names = (f"race-{first}{second}-a", f"race-{first}{second}-b")
            handles = service.race([(names[0], talk[first], "fp8", settings),
                                    (names[1], talk[second], "verified", settings)])
            done = [last(handle) for handle in handles]
            assert done[0].data["tokens"] == alone[("fp8", first)]
            assert done[1].data["tokens"] == alone[("verified", second)]
            assert handles[0].waited > 0 and handles[1].waited > 0
            # the next turn on each raced conversation's kept state == from scratch
            for name, n, reply in zip(names, (first, second), done, strict=True):
                follow = service.render(talk[n]) + reply.data["tokens"] + [40, 41, 42]
                kept = list(service.submit(name, [], "bf16", settings, tokens=follow)
                            .events(timeout=120))
                assert next(e for e in kept if e.kind == "started").data["reused_tokens"] > 0
                fresh = last(service.submit(f"{name}-fresh", [], "bf16", settings,
                                            tokens=follow))
                assert kept[-1].data["tokens"] == fresh.data["tokens"]
    finally:
        service.stop()


def test_kv_windows_are_power_of_two_buckets(hybrid_model, monkeypatch):
    cache = hybrid_model.make_recurrent_cache()
    assert cache.windows() == [256] and cache.window_for(1) == 256  # MIN_WINDOW 256 = buffer
    monkeypatch.setattr(type(cache), "MIN_WINDOW", 16)
    assert cache.windows() == [16, 32, 64, 128, 256]
    assert [cache.window_for(t) for t in (1, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]
    with cache.attending(40):
        assert cache.layers[3].attend_length == 40
    assert cache.layers[3].attend_length == 256
    for bad in (0, 257):
        with pytest.raises(ValueError, match="attend window"):
            cache.set_window(bad)
    gdn_only = unimax.GDNForCausalLM.random(unimax.tiny.TINY_CONFIG, seed=0)
    assert gdn_only.make_recurrent_cache().windows() == [None]


def test_verifier_reads_kv_bucket_by_bucket(hybrid_model, monkeypatch):
    """Verified blocks read only the KV bucket that holds the block's entries, bucket after
    bucket as the reply grows, and still give exact greedy decoding; graphs are keyed by the
    bucket, and a rejection's rollback runs inside the block's graph (no graph of its own)."""
    from test_engine import erring_engine

    monkeypatch.setattr(unimax.cache.RecurrentCache, "MIN_WINDOW", 16)
    x = ids(10, seed=3)
    expected = unimax.exact_greedy_tokens(hybrid_model, x, 70)
    engine = erring_engine(hybrid_model, block_size=8, period=3)
    seen = verifier_launches(engine, monkeypatch, lambda key: (
        key, engine.exact_cache.layers[3].attend_length, engine.exact_cache.seen_tokens))
    got, report = engine.generate_verified(x, 70)
    assert torch.equal(got, expected) and report.rejected_blocks > 0
    verifies = [(key, length, stored) for key, length, stored in seen if key[0] == "verify"]
    assert all(key[0] == "verify" for key, _, _ in seen)
    assert {key[3] for key, _, _ in verifies} == {32, 64, 128}  # 10 + 9 > 16 in block one
    cache = engine.exact_cache
    for (_, k, span, window), length, stored in verifies:
        # every entry it needs (a short block's forward padded to the full one while the
        # buffers have room), and the smallest bucket that holds them
        room = stored + 9 <= cache.max_kv_length
        assert span == (9 if 0 < k < 8 and room else k + 1)
        assert length == window == cache.window_for(stored + span)
        assert stored + span <= window


def test_verifier_keeps_one_window_where_the_kernel_attends(hybrid_model, monkeypatch):
    """Where ops.decode_attention serves every attention call of the verifier's forwards
    (attention.kernel_attends: on CUDA), the KV window changes nothing they compute, so the
    verifier keys every graph by one window, the whole buffer, instead of a bucket per power
    of two: forced on here (the CPU keeps buckets), the reply is still exact greedy through
    rejections, every block reads the whole buffer, and capture prepares one set."""
    from test_engine import erring_engine

    from unimax import attention

    monkeypatch.setattr(unimax.cache.RecurrentCache, "MIN_WINDOW", 16)
    x = ids(10, seed=3)
    expected = unimax.exact_greedy_tokens(hybrid_model, x, 70)
    engine = erring_engine(hybrid_model, block_size=8, period=3)
    verifier = engine.verifier
    assert not verifier.one_window  # the CPU: buckets
    assert len(verifier.windows()) == 5
    verifier.one_window = True
    assert verifier.windows() == [256] and verifier.window_for(20) == 256
    seen = verifier_launches(engine, monkeypatch, lambda key: (
        key, engine.exact_cache.layers[3].attend_length))
    got, report = engine.generate_verified(x, 70)
    assert torch.equal(got, expected) and report.rejected_blocks > 0
    windows = {key[3] if key[0] == "verify" else key[2] for key, _ in seen}
    assert seen and windows == {256} and {n for _, n in seen} == {256}

    # the rule: the flags on, CUDA, a head size the kernel takes, caches in the activations'
    # dtype; blocks up to decode_attention_tokens tokens
    cache = engine.exact_cache
    cuda = types.SimpleNamespace(layers=cache.layers, device=torch.device("cuda"))
    dim, dtype = hybrid_model.config.attn_head_dim, hybrid_model.dtype
    assert attention.kernel_attends(cuda, 9, dim, dtype)
    assert not attention.kernel_attends(cache, 9, dim, dtype)
    longest = kernels.active().decode_attention_tokens
    assert not attention.kernel_attends(cuda, longest + 1, dim, dtype)
    assert not attention.kernel_attends(cuda, 9, 24, dtype)
    assert not attention.kernel_attends(cuda, 9, dim, torch.bfloat16)
    kernels_for_test(monkeypatch, decode_attention_tokens=1)
    assert not attention.kernel_attends(cuda, 9, dim, dtype)


@torch.inference_mode()
def test_attend_window_limits_what_attention_reads(hybrid_model):
    """Entries past the window are never read: NaN there leaves a windowed forward untouched,
    while a forward over the whole buffer is poisoned by them (masked weight 0 x NaN)."""
    x = ids(20, seed=4)
    expected = hybrid_model(x, hybrid_model.make_recurrent_cache()).logits

    def poisoned_cache():
        cache = hybrid_model.make_recurrent_cache()
        for layer in cache.layers:
            if isinstance(layer, unimax.cache.AttentionLayerState):
                layer.key_cache[:, :, 32:] = float("nan")
                layer.value_cache[:, :, 32:] = float("nan")
        return cache

    cache = poisoned_cache()
    with cache.attending(32):
        windowed = hybrid_model.forward_unchecked(x, cache)
    assert torch.allclose(windowed, expected, atol=1e-5)
    assert torch.isnan(hybrid_model.forward_unchecked(x, poisoned_cache())).any()


def test_eager_forwards_attend_causally_without_a_mask(hybrid_model, monkeypatch):
    """Eager forwards (prefill, a prompt on kept KV, a one-token step) give SDPA its causal
    kernels: is_causal on the new keys from an empty cache, a bottom-right causal bias on kept
    KV, nothing for one token; captured forwards (a window) keep the explicit mask. The logits
    agree with the masked computation either way."""
    from torch.nn.attention.bias import CausalBias

    import unimax.attention as attention

    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[2], k.shape[2], type(attn_mask).__name__, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    # (a stand-in for the module attention.py calls through: replacing torch's own function
    # would also change what CausalBias's __torch_function__ recognises)
    functional = types.SimpleNamespace(**vars(attention.F))
    functional.scaled_dot_product_attention = spy
    monkeypatch.setattr(attention, "F", functional)
    x = ids(40, seed=7)
    cache = hybrid_model.make_recurrent_cache()
    eager = [hybrid_model(x[:, :30], cache).logits, hybrid_model(x[:, 30:39], cache).logits,
             hybrid_model(x[:, 39:], cache).logits]
    assert calls == [(30, 30, "NoneType", True), (9, 39, CausalBias.__name__, False),
                     (1, 40, "NoneType", False)]
    calls.clear()
    masked = hybrid_model.make_recurrent_cache()
    parts = []
    for start, end in ((0, 30), (30, 39), (39, 40)):
        with masked.attending(64):  # a graph-style window: the explicit mask
            parts.append(hybrid_model.forward_unchecked(x[:, start:end], masked))
    # (the 9-row block goes through rows_attention instead of SDPA where that is on)
    assert [c[:3] for c in calls] == [(30, 64, "Tensor")] + (
        [] if kernels.active().rows_attention_max >= 9 else [(9, 64, "Tensor")]) + [
        (1, 64, "Tensor")]
    for got, want in zip(eager, parts, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("rows", [2, 9, 16])
def test_rows_attention_equals_sdpa(rows):
    """The verifier-block attention as plain matmuls (grouped query heads, fp32 scores)
    against SDPA with the same mask, GQA included."""
    from unimax.attention import rows_attention

    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(1, 8, rows, 32, generator=gen)
    k, v = torch.randn(2, 1, 2, 70, 32, generator=gen)
    positions = 40 + torch.arange(rows)
    mask = torch.arange(70)[None, :] <= positions[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            scale=0.2, enable_gqa=True)
    assert torch.allclose(rows_attention(q, k, v, mask, 0.2), want, atol=1e-5)


def test_rows_attention_tensor_core_form(monkeypatch):
    """The CUDA form's arithmetic (BF16 inputs with fp32 products, probabilities rounded to
    BF16 before V), with its fp32-output bmm stood in by fp32 matmuls (the CPU has no such
    bmm): within BF16 rounding of fp32 SDPA, over a slice of a longer buffer, GQA included."""
    import unimax.attention as attention

    calls = []

    def bmm_fp32(a, b):
        calls.append((a.dtype, b.dtype))
        return a.float() @ b.float()

    monkeypatch.setattr(attention, "_bmm_fp32", bmm_fp32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 9, 64, generator=gen).bfloat16()
    buffer = torch.randn(2, 1, 2, 128, 64, generator=gen).bfloat16()
    k, v = buffer[:, :, :, :100]  # the cache's first 100 entries
    mask = torch.arange(100)[None, :] <= (90 + torch.arange(9))[:, None]
    got = attention.rows_attention(q, k, v, mask, 0.125, tensor_cores=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125, enable_gqa=True)
    assert calls == [(torch.bfloat16, torch.bfloat16)] * 2  # BF16 into both products
    assert got.dtype == torch.bfloat16
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel  # BF16 output and probabilities: ~3e-3
    fp32_form = attention.rows_attention(q, k, v, mask, 0.125, tensor_cores=False)
    assert float((got.float() - fp32_form.float()).norm() / want.norm()) < 1e-2


def test_verified_with_rows_attention_is_exact(hybrid_model, monkeypatch):
    """With the verifier's blocks through rows_attention, verified decoding on a hybrid model
    is still exact greedy decoding."""

    kernels_for_test(monkeypatch, rows_attention_max=16)
    engine = unimax.build_engine(hybrid_model, decode="fp8", draft="full", block_size=8)
    x = ids(30, seed=8)
    got, _ = engine.generate_verified(x, 24)
    assert torch.equal(got, unimax.exact_greedy_tokens(hybrid_model, x, 24))
