"""Kept states under chat templates that render a reply otherwise in later turns. Qwen3.5's
template ends the prompt with a thinking block (open, or closed and empty) that it leaves out of
earlier replies, so the state after prompt + reply never starts the next turn: the service
keeps the state where the prompt and later turns part instead (chat.history_end), which the
engine's prefill stops at (``generate(checkpoint=...)``)."""

import pytest
import torch
from test_engine import prompt

import unimax
from helpers import QWEN35_TEMPLATE, cache_states, demo_variant, rel_err
from unimax import build_engine
from unimax.presets import Preset
from unimax.service import EngineService, GenerationSettings


@pytest.fixture(scope="module")
def model(pure_or_hybrid):
    return pure_or_hybrid


@pytest.mark.parametrize("mode", ["fast", "verified"])
def test_checkpoint_sees_the_state_after_k_tokens(model, mode):
    x = prompt(40, seed=5) % model.config.vocab_size
    engine = build_engine(model, decode="bf16", block_size=4)
    engine.prefill_chunk = 16  # the checkpoint falls inside a chunked prefill too
    reference = build_engine(model, decode="bf16", block_size=4)
    reference.prefill_exact(x[:, :23])
    seen, progress = [], []

    def keep():
        seen.append(engine.exact_cache.seen_tokens)
        for got, want in zip(cache_states(engine.exact_cache),
                             cache_states(reference.exact_cache), strict=True):
            assert rel_err(got, want) < 1e-5

    got = engine.generate(x, 10, mode=mode, checkpoint=(23, keep),
                          on_prefill=lambda d, t: progress.append((d, t)) or True)
    assert seen == [23] and progress == [(16, 40), (39, 40), (40, 40)]
    assert got.tokens == unimax.exact_greedy_tokens(model, x, 10)[0].tolist()
    for k in (0, 41):  # no room for a checkpoint: one prefill, no call
        assert engine.generate(x, 4, checkpoint=(k, lambda k=k: seen.append(k))).tokens == \
            got.tokens[:4]
    assert seen == [23]
    # after the whole prompt, before any reply token
    reference.prefill_exact(x)
    engine.generate(x, 4, mode=mode, checkpoint=(40, keep))
    assert seen == [23, 40]


@pytest.fixture(scope="module")
def thinking_service(tmp_path_factory):
    folder = demo_variant(tmp_path_factory.mktemp("m") / "qwen35-model", QWEN35_TEMPLATE)
    svc = EngineService(Preset(model=str(folder), block_size=4, dtype="float32",
                               generation=GenerationSettings(max_new_tokens=12))).start()
    yield svc
    svc.stop()


@pytest.mark.parametrize("mode,thinking", [("bf16", None), ("verified", None),
                                           ("bf16", False)])
def test_next_turn_starts_from_the_kept_state(thinking_service, mode, thinking):
    service = thinking_service
    conversation = f"turns-{mode}-{thinking}"
    first = [{"role": "user", "content": "What does json.dumps do?"}]
    settings = GenerationSettings(max_new_tokens=12, thinking=thinking)
    turn1 = list(service.submit(conversation, first, mode, settings).events(timeout=120))
    second = [*first, {"role": "assistant", "content": turn1[-1].data["reply"]},
              {"role": "user", "content": "And json.loads?"}]
    turn2 = list(service.submit(conversation, second, mode, settings).events(timeout=120))
    started = next(e for e in turn2 if e.kind == "started").data
    # what the two prompts share, as transformers renders them, less the token given back
    p1, p2 = service.render(first, thinking), service.render(second, thinking)
    shared = next(i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b)
    assert p1[shared:shared + 1] != [] and shared < len(p1)  # the template parts them
    assert started["reused_tokens"] == shared - 1 > 0
    expected = unimax.exact_greedy_tokens(service.model, torch.tensor([p2]), 12)[0].tolist()
    stop = next((i for i, t in enumerate(expected) if t in service.stop_ids), len(expected))
    assert turn2[-1].data["reply"] == service.tokenizer.decode(expected[:stop],
                                                                skip_special_tokens=True)


def test_where_the_prompt_and_the_next_turn_part(thinking_service):
    from transformers import AutoTokenizer

    from helpers import ROOT
    from unimax.chat import encode_chat, history_end

    messages = [{"role": "user", "content": "hi"}]
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "unimax-demo")  # plain ChatML
    assert history_end(tok, messages, encode_chat(tok, messages)) is None
    # Qwen3.5's: before the thinking block, which a reply right after the prompt keeps and the
    # next user message takes away; with thinking on and off
    tok = thinking_service.tokenizer
    for thinking in (None, False):
        prompt = encode_chat(tok, messages, thinking)
        end = history_end(tok, messages, prompt, thinking)
        assert tok.decode(prompt[:end + 1]).endswith("<|im_start|>assistant\n")
        assert "<think>" in tok.decode(prompt[end + 1:])


def test_a_template_that_raises_is_a_request_error(tmp_path):
    """A chat template's own raise_exception (Qwen's refuse some conversations) reached the
    API as an internal 500; it is the user's to fix, named as the template's refusal."""
    refusing = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    folder = demo_variant(tmp_path / "refusing", template=refusing + "{{ messages[0]['content'] }}")
    service = EngineService(Preset(model=str(folder), device="cpu")).start()
    try:
        two = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
               {"role": "user", "content": "Bye"}]
        event = list(service.submit("c", two, "bf16").events(timeout=60))[-1]
        assert event.kind == "error" and event.data["reason"] == "invalid_request"
        assert "chat template refused" in event.text and "one message only" in event.text
        ok = service.submit("c", two[:1], "bf16", GenerationSettings(max_new_tokens=2))
        assert list(ok.events(timeout=60))[-1].kind == "done"
    finally:
        service.stop()
