"""Draft-ahead verified blocks (unimax.draft_ahead): the next block's drafts made while a block
is checked give exact greedy decoding, keep those drafts exactly when the block accepted all
and its bonus token was the draft's guess, and leave what a reply keeps as the plain loop does;
hybrids and sampling keep the plain loop."""

import pytest
import torch
from test_engine import CONFIG, erring_engine, prompt

import unimax
from helpers import assert_same_turns, spied, two_turns


@pytest.fixture(scope="module")
def model():
    m = unimax.GDNForCausalLM(CONFIG).eval()
    m.init_random_weights(seed=3, std=0.1)  # (test_engine's model)
    return m


def ahead_engine(model, period, block_size=4):
    engine = erring_engine(model, block_size=block_size, period=period)
    engine.draft_ahead = True
    return engine


@torch.inference_mode()
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("period", [3, 7])
def test_draft_ahead_equals_exact_greedy_through_rejections(model, k, period):
    """A draft that errs every ``period``-th step: blocks rejected (the drafts made ahead
    dropped, the draft resynced) and accepted (kept) in one reply, the tokens exact greedy."""
    x = prompt(20, seed=period + k)
    expected = unimax.exact_greedy_tokens(model, x, 40)[0].tolist()
    got = ahead_engine(model, period).generate(x, 40, mode="verified", draft_block=k)
    assert got.tokens == expected
    v = got.verify
    assert v.ahead_dropped > 0  # the draft errs: some blocks' drafts made ahead are dropped
    assert v.ahead_kept > 0 or period == 3  # (erring every third step, few blocks pass whole)


@torch.inference_mode()
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_right_draft_keeps_every_block_drafted_ahead(model, k):
    """A draft that is the exact model: every block drafted ahead is kept and accepted in full,
    none dropped, none rejected (the drafts made on the side are the check's next drafts: the
    draft's cache went on from its own k-th draft, not resynced, and the check left it so)."""
    x = prompt(20, seed=k)
    expected = unimax.exact_greedy_tokens(model, x, 41)[0].tolist()
    engine = ahead_engine(model, period=10 ** 9)
    order = []
    engine.verifier.launch = spied(engine.verifier.launch, "check", order)
    engine.decode_graph.run_block = spied(engine.decode_graph.run_block, "draft", order)
    got = engine.generate(x, 41, mode="verified", draft_block=k)
    assert got.tokens == expected
    v = got.verify
    assert v.rejected_blocks == 0 and v.ahead_dropped == 0
    ahead = (40 - 2 * (k + 1)) // (k + 1) + 1  # blocks with a full block left after them
    assert v.ahead_kept == ahead
    # the first block drafts before its check; each block drafted ahead drafts (k, then the
    # one more) before its check is launched, and never again after it
    assert ",".join(order).startswith("draft," + "draft,draft,check," * ahead)


@torch.inference_mode()
def test_draft_ahead_keeps_what_the_plain_loop_keeps(model):
    """With and without drafts made ahead: the same tokens through a stop id in the middle of
    a block, the same kept state and the same second turn on it."""
    x, y = prompt(20, seed=3), prompt(7, seed=4)
    free = unimax.exact_greedy_tokens(model, x, 40)[0].tolist()
    stop = next(t for t in free[14:] if t not in free[:14])
    runs = []
    for ahead in (False, True):
        engine = erring_engine(model, block_size=4, period=5)
        engine.draft_ahead = ahead
        runs.append(two_turns(engine, x, y, 40, stop, draft_block=3))
    plain, ahead = runs
    assert ahead[0].verify.ahead_kept + ahead[0].verify.ahead_dropped > 0
    assert plain[0].verify.ahead_kept + plain[0].verify.ahead_dropped == 0
    assert_same_turns(plain, ahead, stop, free)


@torch.inference_mode()
def test_hybrids_and_sampling_keep_the_plain_loop(pure_or_hybrid):
    """A hybrid's draft and check share attention KV: no drafts ahead there (and a block
    launched so is refused by name); sampled replies and the adaptive draft length neither."""
    model = pure_or_hybrid
    hybrid = model.make_recurrent_cache().has_attention
    x = torch.randint(0, model.config.vocab_size, (1, 20),
                      generator=torch.Generator().manual_seed(5))
    expected = unimax.exact_greedy_tokens(model, x, 24)[0].tolist()
    engine = ahead_engine(model, period=4)
    got = engine.generate(x, 24, mode="verified", draft_block=3)
    assert got.tokens == expected
    assert (got.verify.ahead_kept + got.verify.ahead_dropped == 0) == hybrid
    for run in (dict(sampling=unimax.SamplingParams(temperature=0.8, seed=1), draft_block=3),
                dict()):
        v = engine.generate(x, 24, mode="verified", **run).verify
        assert v.ahead_kept + v.ahead_dropped == 0
    if hybrid:
        with pytest.raises(ValueError, match="without attention layers"):
            engine.verifier.launch(2, ahead=(None, torch.zeros(1, dtype=torch.long)))


@torch.inference_mode()
def test_the_draft_and_the_check_count_split_launches_apart(model):
    """The draft's blocks and the checks run at once on two streams here: their split-K GEMVs
    (ops.gemv) must count in buffers of their own (a shared one gave wrong tokens on the H200),
    each graph always in the same one, neither the shared buffer of eager forwards."""
    from unimax.ops.gemv import _counters

    engine = ahead_engine(model, period=5)
    seen = {"draft": set(), "check": set()}

    def counted(fn, name):
        def wrapper(*args, **kwargs):
            seen[name].add(_counters(torch.device("cpu")).data_ptr())
            return fn(*args, **kwargs)
        return wrapper

    engine.decode_graph._block = counted(engine.decode_graph._block, "draft")
    engine.verifier._verify = counted(engine.verifier._verify, "check")
    got = engine.generate(prompt(20, seed=6), 30, mode="verified", draft_block=3)
    assert got.verify.ahead_kept + got.verify.ahead_dropped > 0
    assert len(seen["draft"]) == len(seen["check"]) == 1
    assert seen["draft"] != seen["check"]
    assert _counters(torch.device("cpu")).data_ptr() not in seen["draft"] | seen["check"]
