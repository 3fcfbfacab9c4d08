"""Log-probabilities from the exact model (unimax/logprobs.py), called as the service calls
them, in default grad mode: the prompt's entries against transformers' own Qwen3.5 model on
the checkpoint it wrote, and against one full forward of ours on pure and hybrid models, at
every chunking; generated entries against the exact greedy reference and a full forward over
prompt + reply; sampling, stop ids and cancellation."""

import pytest
import torch

import unimax
from helpers import write_qwen_checkpoint
from unimax import logprobs
from unimax.errors import RequestError
from unimax.logprobs import LogprobsRequest, TokenLogprob


def prompt(model, length=23, seed=0):
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def full_logprobs(model, ids):
    """The plain reference: one forward over the whole sequence, no cache."""
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float().log_softmax(-1)


def assert_entries_match(entries: list[TokenLogprob], ids, reference, top: int, start=1):
    """entries[i] is token ids[start + i] as predicted by reference row start + i - 1."""
    for i, entry in enumerate(entries):
        row = reference[start + i - 1]
        assert entry.token == int(ids[0, start + i])
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=2e-5)
        values, indices = row.topk(top)
        assert [t for t, _ in entry.top] == indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=2e-5)
        assert all(a >= b for (_, a), (_, b) in zip(entry.top, entry.top[1:], strict=False))


def test_prompt_logprobs_match_transformers(tmp_path):
    reference = write_qwen_checkpoint(tmp_path, seed=7, num_layers=4,
                                      layer_types=["linear_attention", "full_attention"] * 2)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=64)
    ids = prompt(model, 30)
    with torch.no_grad():
        theirs = reference(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
    entries, last = logprobs.prefill(model, model.make_recurrent_cache(), ids, 3, chunk=7)
    assert entries[0] == TokenLogprob(int(ids[0, 0]), None, [])
    assert len(entries) == ids.shape[1]
    assert_entries_match(entries[1:], ids, theirs, top=3)
    assert torch.allclose(last.float().log_softmax(-1), theirs[-1], atol=2e-5)


@pytest.mark.parametrize("chunk", [1, 5, 23, 100])
def test_prompt_logprobs_at_every_chunking(pure_or_hybrid, chunk):
    model = pure_or_hybrid
    ids = prompt(model)
    reference = full_logprobs(model, ids)
    cache = model.make_recurrent_cache()
    entries, last = logprobs.prefill(model, cache, ids, 4, chunk=chunk)
    assert len(entries) == 23 and entries[0].logprob is None
    assert_entries_match(entries[1:], ids, reference, top=4)
    assert torch.allclose(last.float().log_softmax(-1), reference[-1], atol=2e-5)
    assert cache.seen_tokens == 23
    # without entries: only the next token's logits, the same state
    plain = model.make_recurrent_cache()
    none, last2 = logprobs.prefill(model, plain, ids, None, chunk=chunk)
    assert none == [] and torch.allclose(last2, last, atol=1e-5)


def test_greedy_generation_matches_the_exact_reference(pure_or_hybrid):
    model = pure_or_hybrid
    ids = prompt(model, seed=1)
    cache = model.make_recurrent_cache()
    _, last = logprobs.prefill(model, cache, ids, None, chunk=8)
    entries, stopped = logprobs.generate(model, cache, last, 12, 2)
    assert stopped == "length" and len(entries) == 12
    tokens = [e.token for e in entries]
    assert tokens == unimax.exact_greedy_tokens(model, ids, 12)[0].tolist()
    whole = torch.cat([ids, torch.tensor([tokens])], dim=1)
    assert_entries_match(entries, whole, full_logprobs(model, whole), top=2,
                         start=ids.shape[1])
    assert all(e.top[0][0] == e.token for e in entries)  # greedy: each token is the argmax


def test_stop_ids_end_the_reply_and_cancel_works(pure_or_hybrid):
    model = pure_or_hybrid
    ids = prompt(model, seed=2)
    expected = unimax.exact_greedy_tokens(model, ids, 8)[0].tolist()

    def run(**kwargs):
        cache = model.make_recurrent_cache()
        _, last = logprobs.prefill(model, cache, ids, None, chunk=64)
        return logprobs.generate(model, cache, last, 8, 0, **kwargs)

    stop = expected[3]
    entries, stopped = run(stop_ids=[stop])
    cut = expected.index(stop)
    assert stopped == "stop" and [e.token for e in entries] == expected[:cut]
    seen = []
    entries, stopped = run(on_token=lambda e: seen.append(e) or len(seen) < 2)
    assert stopped == "cancelled" and len(entries) == len(seen) == 2
    assert all(e.top == [] for e in entries)


def test_sampling_is_seeded_and_reports_the_models_logprobs(pure_or_hybrid):
    model = pure_or_hybrid
    ids = prompt(model, seed=3)

    def sample(seed, **params):
        cache = model.make_recurrent_cache()
        _, last = logprobs.prefill(model, cache, ids, None, chunk=64)
        sampling = unimax.SamplingParams(**params)
        generator = torch.Generator().manual_seed(seed)
        return logprobs.generate(model, cache, last, 10, 1, sampling=sampling,
                                 generator=generator)[0]

    hot = sample(5, temperature=3.0)
    assert [e.token for e in hot] == [e.token for e in sample(5, temperature=3.0)]
    assert [e.token for e in hot] != [e.token for e in sample(6, temperature=3.0)]
    whole = torch.cat([ids, torch.tensor([[e.token for e in hot]])], dim=1)
    # the model's own log-probabilities (before temperature), of the drawn tokens
    assert_entries_match(hot, whole, full_logprobs(model, whole), top=1, start=ids.shape[1])
    # top_k 1 leaves only the argmax: sampling is greedy
    greedy = unimax.exact_greedy_tokens(model, ids, 10)[0].tolist()
    assert [e.token for e in sample(9, temperature=1.0, top_k=1)] == greedy


def test_score_chunk_bounds_the_logits_held():
    assert logprobs.score_chunk(248320, 16384) * 248320 * 4 <= logprobs.LOGIT_BYTES
    assert logprobs.score_chunk(4096, 16384) == 16384
    assert logprobs.score_chunk(4096, 100) == 100
    assert logprobs.score_chunk(10**12, 100) == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"top": 21}, "top_logprobs"), ({"top": -1}, "top_logprobs"), ({"top": True}, "top_logprobs"),
    ({"generate": False}, "max_tokens 0"),
])
def test_bad_requests_say_what_to_do(kwargs, message):
    with pytest.raises(RequestError, match=message):
        LogprobsRequest(**kwargs)
