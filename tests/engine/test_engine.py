"""Decode engines on the CPU: fast and verified decoding against the exact greedy reference,
the bridge, stop tokens and kept state, FP8 views."""

import pytest
import torch

import unimax
from helpers import rel_err
from unimax import GDNConfig, GDNForCausalLM, SamplingParams, build_engine
from unimax.cache import cache_payload_bytes
from unimax.fp8 import FP8Linear, default_mode, quantize_view

CONFIG = GDNConfig(vocab_size=89, hidden_size=48, num_hidden_layers=3, num_k_heads=2,
                   num_v_heads=4, head_k_dim=16, head_v_dim=8, intermediate_size=80)


@pytest.fixture(scope="module")
def model():
    m = GDNForCausalLM(CONFIG).eval()
    m.init_random_weights(seed=3, std=0.1)  # peaked enough that greedy text is not constant
    return m


def prompt(length, seed=0):
    return torch.randint(0, 89, (1, length), generator=torch.Generator().manual_seed(seed))


class WrappedDraft(torch.nn.Module):
    """Test-only draft around the exact model: everything is the model's but what a subclass
    changes in ``forward_unchecked``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


class ErringDraft(WrappedDraft):
    """The exact model, except that every ``period``-th step it pushes the logits towards a
    wrong token, so verification must reject, restore and replay."""

    def __init__(self, model, period=4):
        super().__init__(model)
        self.period, self.calls = period, 0

    def forward_unchecked(self, input_ids, cache, logits_to_keep=0):
        logits = self.model.forward_unchecked(input_ids, cache, logits_to_keep)
        self.calls += 1
        if self.calls % self.period == 0:
            wrong = (logits[..., :].argmax(-1) + 1) % logits.shape[-1]
            logits = logits.scatter(-1, wrong.unsqueeze(-1), 1e4)
        return logits


def erring_engine(model, block_size, period=4):
    draft = ErringDraft(model, period)
    graph = unimax.MaxTurboGraphDecoder(draft, block_size=block_size)
    return unimax.UniMaxEngine(model, draft, graph)


@pytest.mark.parametrize("block", [1, 3, 8])
@pytest.mark.parametrize("length,n", [(5, 17), (40, 30), (70, 9)])
def test_verified_equals_exact_greedy_with_rejections(model, block, length, n):
    x = prompt(length, seed=length)
    expected = unimax.exact_greedy_tokens(model, x, n)
    engine = erring_engine(model, block_size=8, period=3)
    got, report = engine.generate_verified(x, n, draft_block=block)
    assert torch.equal(got, expected)
    assert report.generated_tokens == n
    assert report.rejected_blocks > 0  # the restore-and-replay path ran
    # every block emits its accepted drafts and one exact token
    assert report.generated_tokens == 1 + report.accepted_draft_tokens + \
        report.verifier_blocks
    assert report.accepted_draft_tokens <= report.drafted_tokens
    assert 0 <= report.acceptance_rate < 1


@pytest.mark.parametrize("decode,draft", [("bf16", "tail"), ("fp8", "tail"), ("fp8", "full")])
def test_verified_equals_exact_for_each_draft(model, decode, draft):
    x = prompt(12, seed=9)
    expected = unimax.exact_greedy_tokens(model, x, 40)
    engine = build_engine(model, decode=decode, draft=draft, block_size=8)
    got, report = engine.generate_verified(x, 40)
    assert torch.equal(got, expected)
    if decode == "bf16":
        assert report.acceptance_rate == 1.0 and report.rejected_blocks == 0


def test_bf16_fast_equals_exact_greedy(model):
    for length in (1, 33, 90):
        x = prompt(length, seed=length)
        engine = build_engine(model, decode="bf16", block_size=8)
        assert torch.equal(engine.generate_fast(x, 25), unimax.exact_greedy_tokens(model, x, 25))


def test_bridge_copies_bit_exactly_keeps_addresses_and_is_o1(model):
    engine = build_engine(model, decode="fp8", block_size=4)
    dst = engine.decode_graph.cache
    ptrs = [(s.conv_states[0].data_ptr(), s.recurrent_states[0].data_ptr()) for s in dst.layers]
    sizes = []
    for length in (5, 2000):
        _, _, bridge = engine.prefill_exact(prompt(length, seed=1))
        sizes.append(bridge.mib)
        assert bridge.seen_tokens == length == dst.seen_tokens
        for a, b in zip(dst.layers, engine.exact_cache.layers, strict=True):
            assert torch.equal(a.conv_states[0], b.conv_states[0])
            assert torch.equal(a.recurrent_states[0], b.recurrent_states[0])
    assert sizes[0] == sizes[1] == cache_payload_bytes(dst) / 2**20
    assert [(s.conv_states[0].data_ptr(), s.recurrent_states[0].data_ptr())
            for s in dst.layers] == ptrs


def test_fp8_tail_view_shares_weights_and_stays_close(model):
    view = quantize_view(model, "tail")
    assert isinstance(view.lm_head, FP8Linear) and isinstance(view.layers[-1].mlp.down_proj,
                                                             FP8Linear)
    assert not isinstance(model.lm_head, FP8Linear)  # the exact model is untouched
    assert view.layers[0].mlp.gate_up_proj.weight is model.layers[0].mlp.gate_up_proj.weight
    assert view.layers[-1].mixer.in_proj.weight.data_ptr() == \
        model.layers[-1].mixer.in_proj.weight.data_ptr()
    assert view.embed_tokens.weight is model.embed_tokens.weight
    assert view.lm_head.is_emulated and default_mode(torch.device("cpu")) == "emulated"
    x = prompt(50, seed=4)
    with torch.no_grad():
        exact = model(input_ids=x).logits
        tail = view(input_ids=x).logits
    # e4m3 keeps 3 mantissa bits (relative step 1/16); with per-row scales one FP8 GEMV is
    # ~3% off here, and the tail's two MLP GEMVs plus the head measured 4.4e-2.
    assert rel_err(tail, exact) < 0.08
    # the tail changes logits only: states written by the view equal the exact ones
    exact_cache, view_cache = model.make_recurrent_cache(), view.make_recurrent_cache()
    with torch.no_grad():
        model(input_ids=x, past_key_values=exact_cache)
        view(input_ids=x, past_key_values=view_cache)
    for a, b in zip(exact_cache.layers, view_cache.layers, strict=True):
        assert torch.equal(a.recurrent_states[0], b.recurrent_states[0])
    # ...while the full-FP8 draft writes other states: why it may only draft, never bridge.
    full_cache = model.make_recurrent_cache()
    with torch.no_grad():
        quantize_view(model, "full")(input_ids=x, past_key_values=full_cache)
    assert rel_err(full_cache.layers[-1].recurrent_states[0],
                   exact_cache.layers[-1].recurrent_states[0]) > 1e-2


def fresh_state(model, ids):
    cache = model.make_recurrent_cache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return cache


@pytest.mark.parametrize("mode", ["fast", "verified"])
def test_stop_token_leaves_state_of_prompt_plus_reply(model, mode):
    x = prompt(15, seed=5)
    reference = unimax.exact_greedy_tokens(model, x, 40)[0].tolist()
    stop = reference[13]  # stop mid-block (block size 8)
    first_stop = reference.index(stop)
    engine = erring_engine(model, block_size=8, period=5) if mode == "verified" else \
        build_engine(model, decode="fp8", block_size=8)
    blocks = []
    result = engine.generate(x, 40, mode=mode, stop_ids=[stop], on_block=blocks.append)
    if mode == "verified":
        assert result.tokens == reference[: first_stop + 1]
    assert result.tokens[-1] == stop and result.stopped == "stop"
    assert sum(blocks, []) == result.tokens
    expected = fresh_state(model, torch.cat([x, torch.tensor([result.tokens])], dim=1))
    assert engine.exact_cache.seen_tokens == expected.seen_tokens
    for a, b in zip(engine.exact_cache.layers, expected.layers, strict=True):
        assert rel_err(a.recurrent_states[0], b.recurrent_states[0]) < 1e-5
        assert rel_err(a.conv_states[0], b.conv_states[0]) < 1e-5


@pytest.mark.parametrize("mode", ["fast", "verified"])
def test_next_turn_continues_from_kept_state(model, mode):
    turn1, turn2 = prompt(20, seed=6), prompt(7, seed=7)
    engine = build_engine(model, decode="bf16", block_size=8)
    first = engine.generate(turn1, 11, mode=mode)
    assert first.stopped == "length" and len(first.tokens) == 11
    second = engine.generate(turn2, 9, mode=mode, keep_state=True)
    assert second.prefill_tokens == 7
    history = torch.cat([turn1, torch.tensor([first.tokens]), turn2], dim=1)
    assert second.tokens == unimax.exact_greedy_tokens(model, history, 9)[0].tolist()


def test_cancel_after_a_block(model):
    engine = build_engine(model, decode="bf16", block_size=4)
    seen = []
    result = engine.generate(prompt(10), 50, on_block=lambda t: seen.append(t) or len(seen) < 2)
    assert result.stopped == "cancelled" and len(seen) == 2 and len(result.tokens) == 5
    expected = fresh_state(model, torch.cat([prompt(10), torch.tensor([result.tokens])], dim=1))
    assert engine.exact_cache.seen_tokens == expected.seen_tokens


def test_seeded_sampling_is_reproducible_and_respects_top_k(model):
    engine = build_engine(model, decode="bf16", block_size=4)
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=123)
    a = engine.generate(prompt(8), 30, sampling=params).tokens
    b = engine.generate(prompt(8), 30, sampling=params).tokens
    c = engine.generate(prompt(8), 30, sampling=SamplingParams(1.0, 5, 0.9, seed=124)).tokens
    assert a == b and a != c
    greedy = engine.generate(prompt(8), 30).tokens
    assert greedy == unimax.exact_greedy_tokens(model, prompt(8), 30)[0].tolist()


def test_bad_input(model):
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        build_engine(model, block_size=0)
    engine = build_engine(model, decode="fp8", draft="full")
    with pytest.raises(ValueError, match="full-FP8 draft"):
        engine.generate(prompt(3), 5, mode="fast")
    engine = build_engine(model)
    with pytest.raises(ValueError, match="must be >= 0"):
        engine.generate_fast(prompt(3), -1)
    with pytest.raises(ValueError, match="batch size 1"):
        engine.generate_verified(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="draft_block must be an integer in 1..8"):
        engine.generate_verified(prompt(3), 4, draft_block=9)
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        engine.generate(prompt(3), 4, mode="turbo")
    # verified mode samples too (speculative sampling, tests/engine/test_speculative.py)
    assert len(engine.generate(prompt(3), 4, mode="verified",
                               sampling=SamplingParams(0.7, seed=1)).tokens) == 4
    with pytest.raises(ValueError, match="unknown decode mode 'int4'"):
        build_engine(model, decode="int4")
    with pytest.raises(TypeError, match="no recurrent cache"):
        build_engine(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=1.0, top_p=0.0)
    assert engine.generate_fast(prompt(3), 0).shape == (1, 0)
