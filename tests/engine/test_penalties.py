"""Presence, frequency and repetition penalties (unimax.penalties): the graph-safe form against
the plain definition, and penalized replies in every mode against a naive twin (full forwards
without a cache, each step's logits penalized by the plain definition, greedy); verified mode
with forced rejections stays the exact model's greedy reply under the penalties."""


import pytest
import torch

import unimax
from helpers import second_choice_every_third, write_qwen_checkpoint
from unimax.build import build_engine
from unimax.penalties import PenaltySettings, penalize, penalize_reference
from unimax.settings import GenerationSettings, SettingsError

STRONG = PenaltySettings(presence=0.5, frequency=0.4, repetition=1.3)


@pytest.mark.parametrize("settings", [STRONG, PenaltySettings(presence=-0.7),
                                      PenaltySettings(frequency=1.5),
                                      PenaltySettings(repetition=0.6)])
def test_penalize_is_the_plain_definition(settings):
    g = torch.Generator().manual_seed(1)
    vocab = 300
    prompt = torch.randint(0, vocab, (20,), generator=g).tolist()
    replies = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (0, 1, 5, 30)]
    logits = torch.randn(len(replies), vocab, generator=g).to(torch.bfloat16)
    counts = torch.zeros(len(replies), vocab)
    for row, reply in enumerate(replies):
        for token in reply:
            counts[row, token] += 1
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[prompt] = True
    weights = torch.tensor([settings.presence, settings.frequency, settings.repetition])
    got = penalize(logits, counts, in_prompt, weights)
    for row, reply in enumerate(replies):
        want = penalize_reference(logits[row], reply, prompt, settings)
        torch.testing.assert_close(got[row].double(), want, rtol=1e-6, atol=1e-6)
    neutral = torch.tensor([0.0, 0.0, 1.0])
    assert torch.equal(penalize(logits, counts, in_prompt, neutral), logits.float())


def test_settings_check_the_penalties():
    assert GenerationSettings(presence_penalty=-2, frequency_penalty=2,
                              repetition_penalty=1.1).penalties().active
    assert not GenerationSettings().penalties().active
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                         ("repetition_penalty", 0), ("repetition_penalty", 11)):
        with pytest.raises(SettingsError, match=field):
            GenerationSettings(**{field: value})


def twin(model, decoder, prompt: torch.Tensor, n: int, settings: PenaltySettings) -> list[int]:
    """Full forwards without a cache (the first token the exact model's, later ones
    ``decoder``'s), each step's logits penalized by the plain definition, greedy."""
    reply: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([prompt, torch.tensor([reply], dtype=torch.long)], 1)
            logits = (decoder if reply else model)(input_ids=ids).logits[0, -1]
            reply.append(int(penalize_reference(logits, reply, prompt[0].tolist(),
                                                settings).argmax()))
    return reply


def model_at(tmp_path, hybrid: bool):
    types = ["linear_attention", "full_attention"] if hybrid else ["linear_attention"] * 2
    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2, layer_types=types)
    return unimax.load_model(tmp_path, dtype="float32", max_context=128)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("decode, mode", [("bf16", "fast"), ("fp8", "fast"),
                                          ("fp8", "verified")])
def test_penalized_replies_follow_the_twin(tmp_path, hybrid, decode, mode):
    from unimax.fp8 import quantize_view

    model = model_at(tmp_path, hybrid)
    engine = build_engine(model, decode=decode, block_size=4, use_graphs=False)
    decoder = quantize_view(model, "tail") if decode == "fp8" and mode == "fast" else model
    prompt = torch.randint(0, model.config.vocab_size, (1, 9),
                           generator=torch.Generator().manual_seed(5))
    want = twin(model, decoder, prompt, 16, STRONG)
    result = engine.generate(prompt, 16, mode=mode, penalties=STRONG)
    assert result.tokens == want
    plain = engine.generate(prompt, 16, mode=mode)
    assert plain.tokens != want  # the penalties change this reply
    # the next turn goes on from the state after the penalized reply
    again = engine.generate(prompt, 16, mode=mode, penalties=STRONG)
    assert again.tokens == want
    second = torch.randint(0, model.config.vocab_size, (1, 5),
                           generator=torch.Generator().manual_seed(6))
    turn = engine.generate(second, 6, mode=mode, keep_state=True)
    whole = torch.cat([prompt, torch.tensor([want]), second], 1)
    expected = unimax.exact_greedy_tokens(model, whole, 6)[0].tolist()
    assert turn.tokens == expected if decode == "bf16" or mode == "verified" else \
        turn.tokens[0] == expected[0]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("draft", ["tail", "full"])
def test_verified_penalized_blocks_with_forced_rejections(tmp_path, hybrid, draft):
    """The draft made to take its second choice every third draft: rejections at every
    position of the blocks, and the reply is still the exact model's greedy one under the
    penalties (each position checked with the counts after the drafts before it)."""
    model = model_at(tmp_path, hybrid)
    engine = build_engine(model, decode="fp8", draft=draft, block_size=4, use_graphs=False)
    engine.draft_length.forget()
    second_choice_every_third(engine.decode_graph)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9),
                           generator=torch.Generator().manual_seed(5))
    want = twin(model, model, prompt, 20, STRONG)
    result = engine.generate(prompt, 20, mode="verified", penalties=STRONG)
    assert result.tokens == want
    verify = result.verify
    assert verify.drafted_tokens > 0 and verify.rejected_blocks >= 3
