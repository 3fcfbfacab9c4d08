"""The verifier's rewind: the state after an accepted prefix rebuilt from the tape (no second
forward) equals the state a forward over that prefix gives, on pure and hybrid models, for every
prefix length; and a verified reply runs the exact model once per block, never per rejection."""

import pytest
import torch
from test_engine import CONFIG, ErringDraft, erring_engine

import unimax
from helpers import (
    assert_same_turns,
    cache_states,
    kernels_for_test,
    spied,
    stop_case,
    two_turns,
    verifier_launches,
)
from unimax import GDNForCausalLM
from unimax.cache import AttentionLayerState, CacheCopier


@pytest.fixture(scope="module")
def model(pure_or_hybrid):
    return pure_or_hybrid




@torch.inference_mode()
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_rewind_equals_a_forward_over_the_prefix(model, backend):
    model.set_backend(backend)
    try:
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (1, 11), generator=gen)
        block = torch.randint(0, model.config.vocab_size, (1, 6), generator=gen)
        cache = model.make_recurrent_cache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        before = cache.empty_like(share_kv=True)
        unimax.copy_cache_(before, cache)
        tape = model.make_tape(8)
        with cache.recording(tape):
            model.forward_unchecked(block, cache)  # the verifier's forward, k = 6
        # a recording forward leaves the GDN state to the rewind (it would only be overwritten)
        assert torch.equal(cache.recurrent_buffer, before.recurrent_buffer)
        assert torch.equal(cache.conv_buffer, before.conv_buffer)
        for length in range(1, 7):
            model.rewind_unchecked(cache, before, tape, length)
            expected = model.make_recurrent_cache()
            model(input_ids=torch.cat([prompt, block[:, :length]], dim=1),
                  past_key_values=expected, use_cache=True)
            for got, want in zip(cache_states(cache), cache_states(expected), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert int(cache.position) == 11 + length
            # attention reads exactly as a fresh prefill does: the next token's logits agree
            nxt = block[:, length:length + 1] if length < 6 else block[:, :1]
            cache.seen_tokens = expected.seen_tokens
            with cache.attending(cache.seen_tokens + 1):
                got_logits = model.forward_unchecked(nxt, cache)
            want_logits = model(input_ids=nxt, past_key_values=expected, use_cache=True).logits
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        assert any(isinstance(layer, AttentionLayerState) for layer in cache.layers) == \
            (model.config.layer_types is not None and
             "full_attention" in model.config.layer_types)
    finally:
        model.set_backend("auto")


@torch.inference_mode()
@pytest.mark.parametrize("length", [1, 3, 6])
def test_one_pass_rewind_keeps_the_state_before_and_fills_both_caches(model, length):
    """The verifier's rewind with ``copy_to`` (the kernel configuration's one_pass_rewind): from a
    snapshot of the conv states and position alone, taken before the recording forward, it leaves
    the snapshot holding the whole state before the block (recurrent states too: Engine._finish
    restores it after a stop), and the cache and the draft's cache both holding what the plain
    rewind from a full snapshot gives (bit for bit: the same recurrence, the same inputs)."""
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (1, 13), generator=gen)
    block = torch.randint(0, model.config.vocab_size, (1, 7), generator=gen)
    cache = model.make_recurrent_cache()
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    full = unimax.snapshot_cache(cache, cache.empty_like(share_kv=True))
    partial = cache.empty_like(share_kv=True)
    copier = CacheCopier(partial, cache, recurrent=False)  # (its validating copy is a full
    partial.reset()                                        # one: undone here)
    copier()
    assert not partial.recurrent_buffer.any() and torch.equal(partial.conv_buffer,
                                                              cache.conv_buffer)
    draft = cache.empty_like(share_kv=True)
    tape = model.make_tape(8)
    with cache.recording(tape):
        model.forward_unchecked(block, cache)
    plain = unimax.snapshot_cache(cache)
    accepted = torch.tensor(length)
    model.rewind_unchecked(plain, full, tape, accepted, 7)
    model.rewind_unchecked(cache, partial, tape, accepted, 7, copy_to=draft)
    assert torch.equal(partial.recurrent_buffer, full.recurrent_buffer)
    assert torch.equal(partial.conv_buffer, full.conv_buffer)
    for got in (cache, draft):
        assert torch.equal(got.recurrent_buffer, plain.recurrent_buffer)
    assert torch.equal(cache.conv_buffer, plain.conv_buffer)
    assert int(cache.position) == int(plain.position) == 13 + length


@torch.inference_mode()
def test_one_pass_rewind_changes_no_reply_or_kept_state(pure_or_hybrid, monkeypatch):
    """Verified replies with one_pass_rewind on and off: the same tokens through rejections, a
    stop id inside a block (Engine._finish restores the block's snapshot, which the one-pass
    rewind filled) and a second turn on the kept state, and the same drafts accepted (the
    draft's cache resynced alike); pure and hybrid."""
    model = pure_or_hybrid
    x, y, free, stop = stop_case(model, 18, 6, seed=7, cut=11)
    runs = []
    for one_pass in (False, True):
        kernels_for_test(monkeypatch, one_pass_rewind=one_pass)
        engine = erring_engine(model, block_size=5, period=3)
        assert engine.verifier.one_pass is one_pass
        runs.append(two_turns(engine, x, y, 30, stop, draft_block=5))
    assert_same_turns(*runs, stop, free)
    # the draft's cache got the same states too: it drafted the same tokens, accepted alike
    for turn in (0, 1):
        assert runs[0][turn].verify == runs[1][turn].verify


def test_rejections_cost_no_forward(model, monkeypatch):
    """Exact-model forwards in a verified reply: the prefill, one per verified block and the
    end-of-reply fold; a rejection adds none (it rewinds from the tape)."""
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    expected = unimax.exact_greedy_tokens(model, prompt, 40)
    engine = erring_engine(model, block_size=6, period=3)
    calls = []
    forward = model.forward_unchecked
    monkeypatch.setattr(engine.verifier, "forward",
                        lambda ids, *a, **k: calls.append(ids.shape[1]) or forward(ids, *a, **k))
    got, report = engine.generate_verified(prompt, 40)
    assert torch.equal(got, expected)
    assert report.rejected_blocks >= 3
    assert len(calls) == report.verifier_blocks  # one forward per block, none per rejection


@torch.inference_mode()
def test_near_tie_judge_catches_a_wrong_token():
    """first_divergence / is_near_tie, which the GPU tests and benches use to accept BF16
    near-ties: a token the model ranks far down is never judged a near-tie."""
    from unimax.reference import first_divergence, is_near_tie

    bf16 = GDNForCausalLM.random(CONFIG, seed=4).to(torch.bfloat16)
    x = torch.randint(0, CONFIG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    reference = unimax.exact_greedy_tokens(bf16, x, 8)[0].tolist()
    assert is_near_tie(first_divergence(bf16, x, reference, reference))
    cache = bf16.make_recurrent_cache()
    bf16(input_ids=torch.cat([x, torch.tensor([reference[:3]])], dim=1), past_key_values=cache)
    logits = bf16.forward_unchecked(torch.tensor([[reference[3]]]), cache)[0, -1]
    wrong = reference[:4] + [int(logits.argmin())] + reference[5:]
    divergence = first_divergence(bf16, x, wrong, reference)
    assert divergence["index"] == 4 and divergence["exact_paths_differ_by"] >= 0
    assert not is_near_tie(divergence), divergence


@torch.inference_mode()
def test_float32_twin_judges_a_divergence(pure_or_hybrid):
    """first_divergence's float32 verdict (the benches report it beside each near tie): the
    twin computes the BF16 weights' function at least 50x closer to a float64 computation
    than the BF16 model does, leaves the model as it was, and at a divergence reports the
    two tokens' gap as float32 sees it, within the reference's own distance from float32."""
    import copy

    from unimax.reference import first_divergence, float32_logits, float32_twin

    bf16 = copy.deepcopy(pure_or_hybrid).to(torch.bfloat16)
    x = torch.randint(0, bf16.config.vocab_size, (1, 12),
                      generator=torch.Generator().manual_seed(5))
    reference = unimax.exact_greedy_tokens(bf16, x, 8)[0].tolist()
    twin = float32_twin(bf16)
    assert twin.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.layers[0].mixer.backend == "auto"
    assert all(t.data_ptr() != b.data_ptr() for t, b in zip(twin.parameters(),
                                                            bf16.parameters(), strict=True))
    float64 = copy.deepcopy(bf16).double()
    float64.set_backend("torch")
    ids = torch.cat([x, torch.tensor([reference[:4]])], dim=1)
    truth = float64(input_ids=ids, logits_to_keep=1).logits[0, -1]
    twin_off = float((float32_logits(twin, ids).double() - truth).abs().max())
    bf16_off = float((bf16(input_ids=ids, logits_to_keep=1).logits[0, -1].double()
                      - truth).abs().max())
    assert twin_off * 50 < bf16_off, (twin_off, bf16_off)

    cache = bf16.make_recurrent_cache()
    bf16(input_ids=torch.cat([x, torch.tensor([reference[:3]])], dim=1), past_key_values=cache)
    logits = bf16.forward_unchecked(torch.tensor([[reference[3]]]), cache)[0, -1].float()
    runner_up = int(logits.topk(2).indices[1])
    for token in (runner_up, int(logits.argmin())):
        wrong = reference[:4] + [token] + reference[5:]
        divergence = first_divergence(bf16, x, wrong, reference, twin=twin)
        assert divergence["index"] == 4 and divergence["reference_off_float32"] > 0
        assert abs(divergence["float32_gap"] - divergence["gap"]) <= \
            2 * divergence["reference_off_float32"], divergence
    # the last token ranked last: far past BF16 rounding, float32 sides with the reference
    assert 0 < 20 * divergence["reference_off_float32"] < divergence["float32_gap"]
    assert "float32_gap" not in first_divergence(bf16, x, wrong, reference)


@torch.inference_mode()
def test_drafts_queued_ahead_change_nothing(pure_or_hybrid):
    """With the next block's drafts queued before the host reads a block (engine.pipelined,
    the default) and without: the same tokens, reports and kept state, through rejections, the
    adaptive draft length, a stop id in the middle of a block, and a second turn on the kept
    state; pure and hybrid (whose drafts write shared KV ahead of the exact position)."""
    model = pure_or_hybrid
    x, y, free, stop = stop_case(model, 20, 7, seed=3, cut=10)
    runs, orders = [], []
    for pipelined in (False, True):
        engine = erring_engine(model, block_size=4, period=3)
        engine.pipelined = pipelined
        engine.draft_length.calibrate({k: 0.75 * k for k in range(1, 5)},
                                      {k: 1.0 + 0.04 * k for k in range(5)}, rewind_ms=0.0)
        order = []
        engine.verifier.launch = spied(engine.verifier.launch, "check", order)
        engine.decode_graph.run_block = spied(engine.decode_graph.run_block, "draft", order)
        runs.append(two_turns(engine, x, y, 30, stop))
        orders.append(order)
    # (the second turns' blocks may be cut elsewhere: the block ahead is chosen for the fewest
    # tokens that can be left, before the policy saw the block before)
    assert_same_turns(*runs, stop, free)
    a_order, b_order = orders
    # the plain loop drafts only after a check is read; the pipelined one between a check's
    # launch and its read (a draft right after a check, then that check's read)
    assert ",".join(b_order).count("check,draft") > ",".join(a_order).count("check,draft")


def test_span_blocks_are_the_compiled_lengths():
    """The draft counts that get a compiled forward of their own: block_size, and the powers
    of two from the kernel configuration's shortest_span_block (8) below it."""
    from unimax.kernels import DEFAULT
    from unimax.verifier import span_blocks

    assert DEFAULT.shortest_span_block == 8
    assert span_blocks(1) == (1,) and span_blocks(8) == (8,)
    assert span_blocks(16, 4) == (4, 8, 16)
    assert span_blocks(12) == (8, 12) and span_blocks(16) == (8, 16)
    assert span_blocks(32) == (8, 16, 32) and span_blocks(33) == (8, 16, 32, 33)


@pytest.mark.parametrize("compiled", [False, True])
def test_short_blocks_run_the_smallest_span_block_that_holds_them(model, compiled,
                                                                  monkeypatch):
    """block_size 16: a block of up to 8 drafts feeds the exact forward 9 inputs (padded), a
    longer one 17, k = 0 one; the compiled verifier (inductor's CPU backend here) compiles those
    three lengths and runs every block through them; the tokens are exact greedy with rejections
    at every draft length tried, the adaptive one included."""
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    expected = unimax.exact_greedy_tokens(model, prompt, 40)
    draft = ErringDraft(model, period=5)
    graph = unimax.MaxTurboGraphDecoder(draft, block_size=16)
    engine = unimax.UniMaxEngine(model, draft, graph, compile_verifier=compiled)
    verifier = engine.verifier
    assert verifier.span_blocks == (8, 16)
    assert [verifier.span(k, 0) for k in (0, 1, 5, 8, 9, 15, 16)] == [1, 9, 9, 9, 17, 17, 17]
    rows = []
    if compiled:
        compiled_forward = verifier.compiled
        verifier.compiled = lambda ids, *a, **kw: rows.append(ids.shape[1]) or \
            compiled_forward(ids, *a, **kw)
    launches = verifier_launches(engine, monkeypatch)
    rejected = 0
    for block in (3, 8, 12, 16, None):
        got, report = engine.generate_verified(prompt, 40, draft_block=block)
        assert torch.equal(got, expected), block
        rejected += report.rejected_blocks
    assert rejected
    spans = {(key[1], key[2]) for key in launches if key[0] == "verify"}
    assert {span for k, span in spans if 0 < k <= 8} == {9}
    assert {span for k, span in spans if k > 8} == {17}
    if compiled:  # every forward the verifier ran was one of the three compiled lengths
        assert set(rows) == {1, 9, 17}


def test_near_tie_judge_takes_one_ulp_where_the_exact_paths_agree():
    """A divergence one BF16 ulp apart is a tie even where the two exact paths agree (a
    third computation, the verifier's block forward, rounds its own way); two ulps there, or
    a gap past twice the paths' difference, are not."""
    from unimax.reference import is_near_tie

    def divergence(gap, ulps, paths):
        return {"index": 3, "gap": gap, "gap_over_std": 0.01, "gap_bf16_ulps": ulps,
                "exact_paths_differ_by": paths}

    assert is_near_tie(divergence(0.015625, 1.0, 0.0))
    assert not is_near_tie(divergence(0.03125, 2.0, 0.0))
    assert is_near_tie(divergence(0.25, 4.0, 0.125))
    assert not is_near_tie(divergence(0.5, 8.0, 0.125))
