"""Long prompts in chunks: the same state and tokens as one prefill, progress after each chunk,
cancel between chunks, on pure and hybrid models, through the engine and the service."""

import pytest
import torch
from test_engine import prompt

import unimax
from helpers import cache_states, rel_err
from unimax import build_engine
from unimax.presets import Preset
from unimax.service import EngineService, GenerationSettings, RequestHandle


@pytest.fixture(scope="module")
def model(pure_or_hybrid):
    return pure_or_hybrid


@pytest.mark.parametrize("chunk", [7, 64, 100])
def test_chunked_prefill_equals_one_prefill(model, chunk):
    x = prompt(100, seed=2) % model.config.vocab_size
    whole = build_engine(model, decode="bf16", block_size=4)
    first_whole, out_whole, _ = whole.prefill_exact(x)
    engine = build_engine(model, decode="bf16", block_size=4)
    engine.prefill_chunk = chunk
    progress = []
    first, out, _ = engine.prefill_exact(x, on_progress=lambda d, t: progress.append((d, t))
                                         or True)
    assert progress == [(min(s + chunk, 100), 100) for s in range(0, 100, chunk)]
    assert torch.equal(first, first_whole)
    assert rel_err(out.logits[:, -1], out_whole.logits[:, -1]) < 1e-4
    for got, want in zip(cache_states(engine.exact_cache), cache_states(whole.exact_cache),
                         strict=True):
        assert rel_err(got, want) < 1e-4
    assert engine.exact_cache.seen_tokens == 100 == int(engine.exact_cache.position)
    # and the reply is the exact greedy one
    engine.prefill_chunk = chunk
    got = engine.generate(x, 12, mode="verified").tokens
    assert got == unimax.exact_greedy_tokens(model, x, 12)[0].tolist()


def test_cancel_between_chunks(model):
    x = prompt(50, seed=3) % model.config.vocab_size
    engine = build_engine(model, decode="bf16", block_size=4)
    engine.prefill_chunk = 16
    seen = []
    result = engine.generate(x, 8, on_prefill=lambda d, t: seen.append(d) or d < 32)
    assert result.stopped == "cancelled" and result.tokens == [] and seen == [16, 32]
    again = engine.generate(x, 8)  # the next request starts clean
    assert again.tokens == unimax.exact_greedy_tokens(model, x, 8)[0].tolist()
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.prefill_exact(x[:, :0])


def test_service_reports_prefill_progress_and_stops_in_it(monkeypatch):
    """The preset's prefill_chunk reaches the engines; a long prompt streams progress events;
    Stop during the prefill ends the request there, and the conversation goes on cleanly."""
    settings = GenerationSettings(max_new_tokens=4)
    service = EngineService(Preset(model="tiny-random", block_size=4, prefill_chunk=8,
                                   generation=settings)).start()
    try:
        messages = [{"role": "user", "content": "a long question " * 6}]
        events = list(service.submit("p", messages, "bf16", settings).events(timeout=120))
        progress = [e.data for e in events if e.kind == "prefill"]
        assert len(progress) >= 3 and all(p["done"] < p["total"] for p in progress)
        assert [p["done"] for p in progress] == [8 * (i + 1) for i in range(len(progress))]
        assert events[-1].kind == "done" and events[-1].data["stopped"] == "length"

        # Stop pressed as the first progress event goes out (on the engine thread, so the
        # engine is still between chunks when it looks)
        emit, stopped = RequestHandle.emit, []

        def emit_and_stop(handle, kind, text="", **data):
            emit(handle, kind, text, **data)
            if kind == "prefill" and handle.conversation_id == "q" and not stopped:
                stopped.append(handle)
                handle.cancel()

        monkeypatch.setattr(RequestHandle, "emit", emit_and_stop)
        handle = service.submit("q", messages, "bf16", settings)
        events_q = list(handle.events(timeout=120))
        event = events_q[-1]
        assert [e.data["done"] for e in events_q if e.kind == "prefill"] == [8]
        assert event.kind == "done" and event.data["stopped"] == "cancelled"
        assert event.data["reply"] == ""
        again = list(service.submit("q", messages, "bf16", settings).events(timeout=120))
        assert again[-1].data["reply"] == events[-1].data["reply"]  # nothing half-kept
    finally:
        service.stop()


def test_preset_default_chunk_is_the_engines():
    """The app's default (presets.py, which does not import the engine) and the engine's."""
    from unimax.engine import PREFILL_CHUNK
    from unimax.presets import Preset

    assert Preset(model="tiny-random").prefill_chunk == PREFILL_CHUNK
