"""Verified mode with the MTP module's drafts (unimax.mtp_draft, ``draft="mtp"``): the output is
the exact model's greedy decoding at every k, pure and hybrid, through the MTP's own drafts
(random weights: nearly all rejected) and through drafts forced right but for every third
(accepted runs and rejections); and after a reply the MTP's KV holds, at every position the
exact model kept, the entry an MTP forward over the whole final sequence gives, whatever the
blocks accepted (the catch-up's rows, counts and positions)."""

import dataclasses

import pytest
import torch

from unimax import GDNConfig, GDNForCausalLM, build_engine, exact_greedy_tokens
from unimax.mtp_draft import MTPDraft

PURE = GDNConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_k_heads=2,
                 num_v_heads=4, head_k_dim=16, head_v_dim=16, intermediate_size=128,
                 norm_offset=1.0, num_attention_heads=2, num_key_value_heads=1, attn_head_dim=16,
                 max_context=256, mtp_layers=1)
HYBRID = dataclasses.replace(PURE, num_hidden_layers=4, layer_types=(
    "linear_attention", "full_attention") * 2)


@pytest.fixture(params=["pure", "hybrid"])
def model(request):
    config = PURE if request.param == "pure" else HYBRID
    model = GDNForCausalLM.random(config, seed=5)
    model.init_random_weights(5, std=0.1)  # (varied drafts: at 0.02 the MTP says one thing)
    return model


def prompt(seed: int = 0, length: int = 11) -> torch.Tensor:
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


def forced(engine, reference: torch.Tensor) -> list:
    """The drafter's drafts replaced by the exact greedy tokens (``reference``: prompt and
    reply), but every third drafted position wrong; its MTP steps (and so its KV) still run, its
    chain fed the forced first draft, then its own. Returns a list the wrapper fills with each
    block's (tokens kept before it, the MTP's own predictions, the tokens its chain was fed, its
    last hidden state)."""
    drafter, exact = engine.mtp_draft, engine.exact_cache
    real_run, real_catch_up, real_prefill = drafter.run_block, drafter.catch_up, drafter.prefill
    seen, first = [], []

    def oracle(k_from: int, k: int) -> None:
        at = int(exact.position) + 1  # the position of the first draft's token
        for j in range(k_from, k):
            token = int(reference[0, min(at + j, reference.shape[1] - 1)])
            drafter.out_tokens[0, j] = (token + 1) % 97 if (at + j) % 3 == 0 else token

    def run_block(k, record=False):
        kept = int(exact.position) + 1  # (the current token: kept, not yet fed)
        fed = drafter.out_tokens[0, :1].tolist()  # (the forced first; then its own drafts)
        real_run(k, record)
        own = drafter.out_tokens[0, 1:k].tolist()
        seen.append((kept, first[-1:] + own, (fed + own)[:k - 1], drafter.last.clone()))
        oracle(1, k)

    def first_draft(real, *args):
        real(*args)
        first.append(int(drafter.out_tokens[0, 0]))
        oracle(0, 1)

    drafter.run_block = run_block
    drafter.catch_up = lambda *args: first_draft(real_catch_up, *args)
    drafter.prefill = lambda *args: first_draft(real_prefill, *args)
    return seen


def assert_kv_matches_the_whole_sequence(model, engine, sequence: torch.Tensor) -> None:
    """The MTP KV at every position of ``sequence`` (prompt and reply) but its last, where the
    token after it is not known yet, equals an MTP forward over the whole sequence's
    (h_p, x_{p+1}) pairs."""
    kept = sequence.shape[1] - 1
    assert int(engine.mtp_draft.cache.position) == kept
    out = model(input_ids=sequence, return_hidden=True)
    reference = model.mtp.make_cache()
    with torch.no_grad():
        model.mtp(out.hidden[:, :kept], model.embed_tokens(sequence[:, 1:kept + 1]), reference)
    for got, want in zip(engine.mtp_draft.cache.layers, reference.layers, strict=True):
        for a, b in ((got.key_cache, want.key_cache), (got.value_cache, want.value_cache)):
            torch.testing.assert_close(a[:, :, :kept], b[:, :, :kept], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_mtp_drafts_decode_exact_greedy(model, k):
    x = prompt()
    reference = exact_greedy_tokens(model, x, 30)
    engine = build_engine(model, decode="fp8", draft="mtp", block_size=4)
    assert isinstance(engine.mtp_draft, MTPDraft) and engine.decode_model is model
    tokens, report = engine.generate_verified(x, 30, draft_block=k)
    assert torch.equal(tokens, reference)
    assert report.drafted_tokens > 0
    assert_kv_matches_the_whole_sequence(model, engine, torch.cat([x, tokens], dim=1))


def reference_drafts(model, sequence: torch.Tensor, fed: list[int]):
    """What an MTP module that has seen every (h_p, x_{p+1}) pair of ``sequence`` (the tokens
    kept so far, the last not yet fed) predicts, and its last hidden state: at the last pair,
    then chained on its own hidden states and the tokens ``fed``."""
    out = model(input_ids=sequence, return_hidden=True)
    cache = model.mtp.make_cache()
    with torch.no_grad():
        h = model.mtp(out.hidden[:, :-1], model.embed_tokens(sequence[:, 1:]), cache)[:, -1:]
        drafts = [int(model.lm_head(h)[0, -1].argmax())]
        for token in fed:
            h = model.mtp(h, model.embed_tokens(torch.tensor([[token]])), cache)
            drafts.append(int(model.lm_head(h)[0, -1].argmax()))
    return drafts, h


def test_each_blocks_drafts_are_the_mtps_over_the_kept_tokens(model):
    """Every block's drafts are what the MTP module predicts after the tokens kept so far (its
    KV over exactly those, rejected rows never read), with forced accepted runs and
    rejections."""
    x = prompt(4)
    reference = exact_greedy_tokens(model, x, 24)
    full = torch.cat([x, reference], dim=1)
    engine = build_engine(model, decode="fp8", draft="mtp", block_size=4)
    engine.pipelined = False  # (each block's drafts after its check is read: the state known)
    seen = forced(engine, full)
    tokens, report = engine.generate_verified(x, 24, draft_block=3)
    assert torch.equal(tokens, reference) and report.accepted_draft_tokens > 0
    assert len(seen) > 4
    for kept, predicted, fed, last in seen:
        drafts, h = reference_drafts(model, full[:, :kept], fed)
        assert predicted == drafts, kept
        torch.testing.assert_close(last, h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_forced_mtp_drafts_are_accepted_and_rejected_exactly(model, k):
    x = prompt(1)
    reference = exact_greedy_tokens(model, x, 40)
    engine = build_engine(model, decode="fp8", draft="mtp", block_size=4)
    seen = forced(engine, torch.cat([x, reference], dim=1))
    tokens, report = engine.generate_verified(x, 40, draft_block=k)
    assert seen
    assert torch.equal(tokens, reference)
    assert 0 < report.accepted_draft_tokens < report.drafted_tokens  # both paths taken
    assert_kv_matches_the_whole_sequence(model, engine, torch.cat([x, tokens], dim=1))


def test_chat_turns_and_sampled_replies_on_an_mtp_engine(model):
    """generate (the chat path): a greedy verified reply equals exact greedy, a second turn on
    the kept state too (the MTP's first draft from the new prompt's last row); a sampled
    verified reply runs exact runs (MTP drafts are greedy only) and leaves the MTP's KV in
    step over them."""
    from unimax import SamplingParams

    engine = build_engine(model, decode="fp8", draft="mtp", block_size=4)
    x, y = prompt(2), prompt(3, 5)
    first = engine.generate(x, 12, mode="verified")
    assert first.tokens == exact_greedy_tokens(model, x, 12)[0].tolist()
    history = torch.cat([x, torch.tensor([first.tokens])], dim=1)
    second = engine.generate(y, 10, mode="verified", keep_state=True)
    assert second.tokens == exact_greedy_tokens(model, torch.cat([history, y], dim=1),
                                                10)[0].tolist()
    sampled = engine.generate(x, 14, mode="verified",
                              sampling=SamplingParams(temperature=0.8, seed=3))
    assert len(sampled.tokens) == 14 and sampled.verify.drafted_tokens == 0
    assert_kv_matches_the_whole_sequence(model, engine,
                                         torch.cat([x, torch.tensor([sampled.tokens])], dim=1))


def test_draft_mtp_needs_the_weights():
    plain = GDNForCausalLM.random(dataclasses.replace(PURE, mtp_layers=0))
    with pytest.raises(ValueError, match="draft 'mtp' needs a checkpoint with Qwen3.5's MTP"):
        build_engine(plain, decode="fp8", draft="mtp")


def test_a_service_with_the_mtp_draft_serves_exact_replies():
    """The app's service with ``draft: mtp``: a verified reply (drafted by the MTP module)
    is BF16-only's reply token for token; a preset asking for MTP drafts of a model without
    the module is refused at start, by name."""
    from unimax.presets import Preset, PresetError
    from unimax.service import EngineService, GenerationSettings

    base = EngineService(Preset(model="tiny-random"))
    config = dataclasses.replace(base.model.config, mtp_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, attn_head_dim=16)
    model = GDNForCausalLM.random(config, seed=2)
    model.init_random_weights(2, std=0.1)
    preset = Preset(model="tiny-random", draft="mtp", block_size=4)
    service = EngineService(preset, model=model, tokenizer=base.tokenizer).start()
    try:
        replies = {}
        for mode in ("bf16", "verified"):
            handle = service.submit(mode, [{"role": "user", "content": "Hello there"}], mode,
                                    GenerationSettings(max_new_tokens=24))
            done = list(handle.events(timeout=120))[-1]
            assert done.kind == "done", done.text
            replies[mode] = done.text
            if mode == "verified":
                assert done.data["stats"]["drafted_tokens"] > 0, done.data["stats"]
        assert replies["verified"] == replies["bf16"]
    finally:
        service.stop()
    with pytest.raises(PresetError, match="draft is 'mtp' but tiny-random has no MTP module"):
        EngineService(preset, model=base.model, tokenizer=base.tokenizer)
