"""The grammar's mask inside the engines' graphs (unimax.token_mask) against its naive twin,
xgrammar's own ``apply_token_bitmask_inplace``, on random bitmasks, and the held steps' guards.
The replies it serves are tested against the twin decoder in tests/service/test_structured.py."""

from unittest import mock

import pytest
import torch

from unimax.token_mask import TokenMask


@pytest.mark.parametrize("vocab", [32, 100, 4096, 4099])
def test_the_mask_is_xgrammars(vocab):
    xgr = pytest.importorskip("xgrammar")
    generator = torch.Generator().manual_seed(vocab)
    mask = TokenMask(vocab, torch.device("cpu"))
    for _ in range(4):
        words = torch.randint(-2**31, 2**31, mask.host.shape, generator=generator,
                              dtype=torch.int64).to(torch.int32)
        mask.host.copy_(words)
        mask.bits.copy_(mask.host)
        logits = torch.randn(1, vocab, generator=generator).to(torch.bfloat16)
        want = logits.float().clone()
        xgr.apply_token_bitmask_inplace(want, words, vocab_size=vocab, backend="cpu")
        got = mask.apply(logits)
        assert got.dtype == torch.float32  # (the penalties' dtype; neutral here)
        assert torch.equal(got.float(), want)


class Always:
    """A constraint whose grammar allows token 3 only (or everything while inactive)."""

    def __init__(self, active=True):
        self.active = active

    def fill(self, out):
        out.zero_()
        out[0, 0] = 1 << 3
        if not self.active:
            out.fill_(-1)


def test_load_fills_from_the_constraint():
    mask = TokenMask(70, torch.device("cpu"))
    logits = torch.zeros(1, 70)
    mask.load(Always())
    assert mask.apply(logits).argmax() == 3 and torch.isinf(mask.apply(logits)).sum() == 69
    mask.load(Always(active=False))
    assert torch.equal(mask.apply(logits), logits)


def test_structured_constraint_fills_every_token_while_inactive():
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from helpers import ROOT
    from unimax.structured import Constraint, Grammars, response_format

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "unimax-demo")
    vocab = len(tokenizer)
    compiled = Grammars(tokenizer, vocab, [tokenizer.eos_token_id]).compile(
        response_format({"type": "json_object"}))
    constraint = Constraint(compiled, vocab, active=False)
    mask = TokenMask(vocab, torch.device("cpu"))
    mask.load(constraint)
    assert bool((mask.host == -1).all())
    constraint.active = True
    mask.load(constraint)
    allowed = ~torch.isinf(mask.apply(torch.zeros(1, vocab)))
    texts = {tokenizer.decode([t]) for t in allowed.nonzero()[:, 1].tolist()}
    assert 0 < len(texts) < vocab // 10 and all(t.strip() in ("{", "") for t in texts), texts


def test_a_held_choice_needs_its_mask_and_forward():
    import unimax
    from helpers import ROOT
    from unimax.graph import MaxTurboGraphDecoder

    model = unimax.load_model(str(ROOT / "models" / "unimax-demo"), device="cpu")
    decoder = MaxTurboGraphDecoder(model, block_size=4, use_graphs=False)
    decoder.held_forward()
    with pytest.raises(ValueError, match="needs token_mask set"):
        decoder.held_choice()  # no token_mask set
    decoder = MaxTurboGraphDecoder(model, block_size=4, use_graphs=False)
    decoder.token_mask = TokenMask(model.config.vocab_size, torch.device("cpu"))
    with pytest.raises(ValueError, match="a held_forward before it"):
        decoder.held_choice()


class Subsets:
    """A stand-in grammar: before each token a random half of the vocabulary is allowed (drawn
    from the tokens taken so far), so that the mask changes every step; records what it was
    fed. ``allowed(reply)`` is the twin's view of the same sets."""

    def __init__(self, vocab: int):
        self.vocab, self.taken, self.active = vocab, [], True

    def allowed(self, reply: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + 7 * len(reply) + sum(reply))
        return torch.rand(self.vocab, generator=g) < 0.5

    def fill(self, out):
        out.fill_(-1)
        if self.active:
            keep = torch.zeros(out.shape[1] * 32, dtype=torch.bool)
            keep[:self.vocab] = self.allowed(self.taken)
            bits = keep.view(-1, 32).long() << torch.arange(32)
            out.copy_(bits.sum(1).remainder(2**32).to(torch.int32)[None])

    def accept(self, token: int):
        self.taken.append(int(token))

    def rollback(self, count: int):
        del self.taken[len(self.taken) - count:]


def masked_twin(model, decoder, prompt: torch.Tensor, n: int, grammar) -> list[int]:
    """The naive twin of a held reply: full forwards without a cache (the first token the exact
    model's, later ones ``decoder``'s), each step's logits masked by ``grammar``'s sets while it
    is active, greedy; ``grammar`` takes each token (a Thinking one opens at its close)."""
    reply: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([prompt, torch.tensor([reply], dtype=torch.long)], 1)
            logits = (decoder if reply else model)(input_ids=ids).logits[0, -1]
            if grammar.active:
                logits = logits.masked_fill(~grammar.allowed(grammar.taken), -torch.inf)
            reply.append(int(logits.argmax()))
            grammar.accept(reply[-1])
    return reply


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("decode, mode", [("bf16", "fast"), ("fp8", "fast"),
                                          ("fp8", "verified")])
def test_held_replies_follow_the_masked_twin(tmp_path, hybrid, decode, mode, ahead):
    """The engine's held steps (the decoder's in fast mode, the verifier's exact step in
    verified mode) against full forwards without a cache, each step's logits masked by the same
    sets; the fp8 twin takes its steps after the first from the FP8 tail's forward, as fp8 mode
    does. Pure GDN and a hybrid with attention; a stop id inside the reply ends it. Each
    token's forward queued before the host reads the token (``held_ahead``, the engine's
    default) and after."""
    import unimax
    from helpers import write_qwen_checkpoint
    from unimax.build import build_engine
    from unimax.fp8 import quantize_view

    types = ["linear_attention", "full_attention"] if hybrid else ["linear_attention"] * 2
    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2, layer_types=types)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=128)
    vocab = model.config.vocab_size
    engine = build_engine(model, decode=decode, block_size=4, use_graphs=False)
    engine.held_ahead = ahead
    decoder = quantize_view(model, "tail") if decode == "fp8" and mode == "fast" else model
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(5))
    reply = masked_twin(model, decoder, prompt, 12, Subsets(vocab))
    grammar = Subsets(vocab)
    stop = reply[7]
    expected = reply[:reply.index(stop) + 1]
    result = engine.generate(prompt, 12, mode=mode, stop_ids=[stop], constraint=grammar)
    assert result.tokens == expected and result.stopped == "stop"
    assert grammar.taken == expected
    # without the mask the reply is another
    assert engine.generate(prompt, 12, mode=mode).tokens[:len(expected)] != expected
    # and the next turn goes on from the state after the reply, as for any reply: one ended
    # by its stop id, one by its length
    second = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(6))
    for limit in (12, 3):
        held = engine.generate(prompt, limit, mode=mode, stop_ids=[stop],
                               constraint=Subsets(vocab))
        assert held.tokens == expected[:limit]
        turn = engine.generate(second, 6, mode=mode, keep_state=True)
        whole = torch.cat([prompt, torch.tensor([expected[:limit]]), second], 1)
        if decode == "bf16" or mode == "verified":
            assert turn.tokens == unimax.exact_greedy_tokens(model, whole, 6)[0].tolist()
        else:  # fp8: its first token is the exact model's
            assert turn.tokens[0] == unimax.exact_greedy_tokens(model, whole, 1)[0, 0]


class Thinking(Subsets):
    """Subsets behind a thinking block: every token allowed and none fed to the grammar until
    ``close`` is taken (structured.Constraint's ``opens``), then the grammar's sets."""

    def __init__(self, vocab: int, close: int):
        super().__init__(vocab)
        self.active, self.close, self.thought = False, close, []

    def accept(self, token: int):
        if self.active:
            super().accept(token)
        else:
            self.thought.append(int(token))
            self.active = int(token) == self.close


def first_new(tokens: list[int], start: int) -> int:
    """The first index from ``start`` whose token is not among those before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("decode, mode", [("bf16", "fast"), ("fp8", "fast"),
                                          ("fp8", "verified")])
def test_a_thinking_block_decodes_in_blocks_before_the_grammar(tmp_path, hybrid, decode, mode):
    """A grammar behind an open thinking block: the thinking decodes as any reply does, in
    blocks (verified mode: drafted and checked), the block that holds its closing token ends
    there (the close falls inside a 4-token block), and the grammar holds from the next
    token, one held step at a time. Against the twin: full forwards without a cache, no mask
    up to the close, the grammar's sets after it; the next turn goes on from the kept
    state."""
    import unimax
    from helpers import write_qwen_checkpoint
    from unimax.build import build_engine
    from unimax.fp8 import quantize_view

    types = ["linear_attention", "full_attention"] if hybrid else ["linear_attention"] * 2
    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2, layer_types=types)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=128)
    vocab = model.config.vocab_size
    engine = build_engine(model, decode=decode, block_size=4, use_graphs=False)
    decoder = quantize_view(model, "tail") if decode == "fp8" and mode == "fast" else model
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(5))

    def twin(close: int | None) -> list[int]:
        return masked_twin(model, decoder, prompt, 16, Thinking(vocab, close))

    free = twin(None)
    at = first_new(free, 6)  # (inside the second 4-token block: tokens 5..8)
    close = free[at]
    reply = twin(close)
    assert reply[:at + 1] == free[:at + 1] and reply != free  # the grammar made a difference
    stop = reply[first_new(reply, at + 3)]
    expected = reply[:reply.index(stop) + 1]
    blocks = []
    engine.decode_graph.run_block = mock.Mock(wraps=engine.decode_graph.run_block)
    grammar = Thinking(vocab, close)
    result = engine.generate(prompt, 16, mode=mode, stop_ids=[stop], constraint=grammar,
                             on_block=lambda tokens: blocks.append(list(tokens)) is None)
    assert result.tokens == expected and result.stopped == "stop"
    assert grammar.thought == expected[:at + 1] and grammar.taken == expected[at + 1:]
    # the thinking ran the mode's blocks; after it fast modes step one token a block, verified
    # mode drafts under the grammar (_held_verified_loop)
    assert engine.decode_graph.run_block.called
    assert any(len(b) > 1 for b in blocks) and sum(blocks, []) == expected
    if mode == "fast":
        assert blocks[-1] == [stop]
    else:
        assert result.verify.drafted_tokens > 0
    second = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(6))
    turn = engine.generate(second, 6, mode=mode, keep_state=True)
    whole = torch.cat([prompt, torch.tensor([expected]), second], 1)
    if decode == "bf16" or mode == "verified":
        assert turn.tokens == unimax.exact_greedy_tokens(model, whole, 6)[0].tolist()
    else:  # fp8: its first token is the exact model's
        assert turn.tokens[0] == unimax.exact_greedy_tokens(model, whole, 1)[0, 0]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("draft", ["tail", "full"])
def test_verified_blocks_under_a_grammar_with_forced_rejections(tmp_path, hybrid, draft):
    """Verified mode drafts under the grammar and checks each block against the grammar's
    masks (engine._held_verified_loop): with the draft made to take the second-best allowed
    token every third draft (so rejections fall at every position of the 4-token blocks),
    the reply is still the masked twin's (exact greedy under the grammar), the grammar took
    back every rejected draft, and the next turn goes on from the kept state."""
    import unimax
    from helpers import second_choice_every_third, write_qwen_checkpoint
    from unimax.build import build_engine

    types = ["linear_attention", "full_attention"] if hybrid else ["linear_attention"] * 2
    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2, layer_types=types)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=128)
    vocab = model.config.vocab_size
    engine = build_engine(model, decode="fp8", draft=draft, block_size=4, use_graphs=False)
    second_choice_every_third(engine.decode_graph)
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(5))
    reply = masked_twin(model, model, prompt, 20, Subsets(vocab))
    grammar = Subsets(vocab)
    result = engine.generate(prompt, 20, mode="verified", constraint=grammar)
    assert result.tokens == reply and grammar.taken == reply
    verify = result.verify
    assert verify.drafted_tokens > 0 and verify.rejected_blocks >= 3
    assert verify.accepted_draft_tokens < verify.drafted_tokens
    second = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(6))
    turn = engine.generate(second, 6, mode="verified", keep_state=True)
    whole = torch.cat([prompt, torch.tensor([reply]), second], 1)
    assert turn.tokens == unimax.exact_greedy_tokens(model, whole, 6)[0].tolist()


@pytest.mark.parametrize("hybrid", [False, True])
def test_verified_held_replies_mix_exact_runs_and_drafted_blocks(tmp_path, hybrid):
    """Where drafts do not pay, a verified held reply runs exact held steps (k = 0 as an exact
    run of the verifier's held steps, engine._held_steps) between drafted blocks. With the
    policy's choices scripted so that runs of 1-3 exact steps and blocks of 1-3 drafts
    alternate: the reply is the masked
    twin's, the grammar took exactly the reply, every drafted block starts from a draft cache
    equal to the exact one (an exact run advanced only the exact cache: the engine bridges it
    first), a stop id inside the reply ends it, and the next turn goes on from the kept state."""
    import itertools

    import unimax
    from helpers import write_qwen_checkpoint
    from unimax.build import build_engine

    types = ["linear_attention", "full_attention"] if hybrid else ["linear_attention"] * 2
    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2, layer_types=types)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=128)
    vocab = model.config.vocab_size
    engine = build_engine(model, decode="fp8", draft="tail", block_size=4, use_graphs=False)
    policy, draft, exact = engine.draft_length, engine.decode_graph.cache, engine.exact_cache
    shapes = []  # ("run", steps) / ("block", drafts), as they ran

    def scripted():
        ks, runs = itertools.cycle([0, 2, 0, 3, 1, 0, 1]), itertools.cycle([3, 1, 2])

        def choose(remaining, extra=None):
            policy.probe = 0
            return min(next(ks), remaining - 1)

        def exact_run(limit):
            return min(next(runs), limit)

        policy.choose, policy.exact_run = choose, exact_run

    real_block, real_run = engine._held_block, engine._held_steps

    def block(k, *args):
        assert draft.seen_tokens == exact.seen_tokens
        assert torch.equal(draft.recurrent_buffer, exact.recurrent_buffer)
        assert torch.equal(draft.conv_buffer, exact.conv_buffer)
        emitted, k = real_block(k, *args)
        shapes.append(("block", k, len(emitted)))
        return emitted, k

    def run(steps, count, result, *args, **kwargs):
        before = len(result.tokens)
        going = real_run(steps, count, result, *args, **kwargs)
        shapes.append(("run", len(result.tokens) - before, len(result.tokens) - before))
        return going

    engine._held_block, engine._held_steps = block, run
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(5))
    reply = masked_twin(model, model, prompt, 20, Subsets(vocab))
    scripted()
    grammar = Subsets(vocab)
    result = engine.generate(prompt, 20, mode="verified", constraint=grammar)
    assert result.tokens == reply and grammar.taken == reply
    assert ("run", 3, 3) in shapes and any(s[:2] == ("block", 3) for s in shapes)
    assert any(a[0] == "run" and b[0] == "block" for a, b in itertools.pairwise(shapes))
    assert 0 < result.verify.drafted_tokens < 20
    # a stop id inside an exact run, before its last step (the first token is the prefill's)
    starts = list(itertools.accumulate([1] + [s[2] for s in shapes]))
    inside = [i for start, s in zip(starts, shapes, strict=False) if s[0] == "run"
              for i in range(start, start + s[2] - 1) if reply.index(reply[i]) == i]
    assert inside, (shapes, reply)
    second = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(6))
    for stop in (None, reply[inside[0]]):
        stops = [] if stop is None else [stop]
        expected = reply if stop is None else reply[:reply.index(stop) + 1]
        scripted()
        held = engine.generate(prompt, 20, mode="verified", stop_ids=stops,
                               constraint=Subsets(vocab))
        assert held.tokens == expected
        turn = engine.generate(second, 6, mode="verified", keep_state=True)
        whole = torch.cat([prompt, torch.tensor([expected]), second], 1)
        assert turn.tokens == unimax.exact_greedy_tokens(model, whole, 6)[0].tolist()


def test_a_verified_held_reply_takes_exact_runs_where_its_host_turns_cost_more(tmp_path):
    """The policy prices a held reply's host turns (engine.held_host): calibrated with costs
    under which drafting pays, a held reply drafts; with a host turn per draft dearer than a
    step it takes exact runs (k = 0) only, and its tokens are the masked twin's either way."""
    import unimax
    from helpers import write_qwen_checkpoint
    from unimax.build import build_engine
    from unimax.held import HostTurns

    write_qwen_checkpoint(tmp_path, seed=3, num_layers=2)
    model = unimax.load_model(tmp_path, dtype="float32", max_context=128)
    vocab = model.config.vocab_size
    engine = build_engine(model, decode="fp8", block_size=4, use_graphs=False)
    engine.draft_length.calibrate({k: 0.5 * k for k in range(1, 5)},
                                  {k: 1.0 + 0.02 * k for k in range(5)}, rewind_ms=0.0)
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(5))
    reply = masked_twin(model, model, prompt, 16, Subsets(vocab))
    drafted = {}
    for cost in (0.0, 5.0):
        engine.held_host = HostTurns(draft_ms=cost, learn=False)
        engine.draft_length.forget()
        result = engine.generate(prompt, 16, mode="verified", constraint=Subsets(vocab))
        assert result.tokens == reply
        drafted[cost] = result.verify.drafted_tokens
    assert drafted[0.0] > 0 and drafted[5.0] == 0
