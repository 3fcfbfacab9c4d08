"""Verified sampling: the speculative rule against its plain twin on fixed p, q and uniforms;
the warped distribution against the sampler's definition; and end to end, with a deliberately
distorted draft, verified samples distributed as the exact model's (a chi-square test over many
seeds) where the draft's own samples are not; seeds reproduce."""

import dataclasses
import itertools
import math

import pytest
import torch
from test_engine import WrappedDraft

import unimax
from helpers import cache_states
from unimax import GDNConfig, GDNForCausalLM, SamplingParams
from unimax.sampling import sample_reference, warped_probs, warped_probs_reference
from unimax.speculative import speculative_reference, speculative_step


def random_dist(rows, vocab, gen, sparse=False):
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    if sparse:  # some tokens impossible, as top-k / top-p make them
        logits[torch.rand(rows, vocab, generator=gen) < 0.4] = -math.inf
        logits[:, 0] = 1.0  # at least one left in every row
    return logits.softmax(-1)


@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("sparse", [False, True])
def test_speculative_step_matches_the_rule(k, sparse):
    gen = torch.Generator().manual_seed(k + 10 * sparse)
    for case in range(200):
        p = random_dist(k + 1, 7, gen, sparse)
        q = random_dist(k, 7, gen, sparse)
        # drafts sampled from q (as the draft does), sometimes one q gave no mass (distorted)
        draft = torch.multinomial(q, 1, generator=gen)[:, 0] if k else torch.zeros(0, dtype=int)
        u = torch.rand(k, generator=gen, dtype=torch.float64)
        u_final = torch.rand(1, generator=gen, dtype=torch.float64)
        m, token = speculative_step(p, q, draft, u, u_final)
        want = speculative_reference(p, q, draft.tolist(), u.tolist(), float(u_final))
        assert (int(m), int(token)) == want, (case, p, q, draft, u, u_final)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.6),
                                    SamplingParams(temperature=0.9, top_k=5, top_p=0.8),
                                    SamplingParams(temperature=1.2, min_p=0.2),
                                    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1)])
def test_warped_probs_is_what_the_sampler_draws_from(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=gen) * 2
    probs = warped_probs(logits, torch.tensor([params.temperature]),
                         torch.tensor([params.top_k]), torch.tensor([params.top_p]),
                         torch.tensor([params.min_p]))
    for row in range(3):
        want = warped_probs_reference(logits[row], params)
        assert torch.allclose(probs[row].double(), want, atol=1e-6)
        # inverse-CDF sampling of the reference lands on tokens with mass, in proportion
        hits = torch.zeros(11, dtype=torch.float64)
        for u in torch.linspace(0.0005, 0.9995, 1000).tolist():
            hits[sample_reference(logits[row], params, u)] += 1
        assert torch.allclose(hits / 1000, want, atol=2.5e-3)


# --- end to end ------------------------------------------------------------------------------

VOCAB = 5
CONFIG = GDNConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_k_heads=2,
                   num_v_heads=2, head_k_dim=8, head_v_dim=8, intermediate_size=48)


@pytest.fixture(scope="module")
def model():
    m = GDNForCausalLM(CONFIG).eval()
    m.init_random_weights(seed=2, std=0.35)  # peaked enough that the joint is far from uniform
    return m


class DistortedDraft(WrappedDraft):
    """The exact model with its logits bent: halved and shifted towards token 0 (a draft whose
    distribution differs a lot from p, so rejections and residual draws happen often)."""

    def forward_unchecked(self, input_ids, cache, logits_to_keep=0):
        logits = self.model.forward_unchecked(input_ids, cache, logits_to_keep)
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype)
        bias[0] = 2.0
        return logits * 0.5 + bias


def distorted_engine(model, block_size=3):
    draft = DistortedDraft(model)
    return unimax.UniMaxEngine(model, draft, unimax.MaxTurboGraphDecoder(draft, block_size))


PARAMS = SamplingParams(temperature=1.0, top_k=4)
MIN_P = SamplingParams(temperature=1.5, min_p=0.3)  # (over top-k 4's cut at this vocabulary)
PROMPT = torch.tensor([[1, 3, 2, 4]])
NEW = 3


@torch.inference_mode()
def joint(model_like, params, grammar=None) -> dict[tuple, float]:
    """P(the next NEW tokens) under model_like's warped distribution, by enumeration;
    ``grammar`` (TwoBarred): each step's logits masked by its ``allowed`` sets first."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        prob = 1.0
        for i in range(NEW):
            ids = torch.cat([PROMPT, torch.tensor([seq[:i]], dtype=torch.long)], dim=1)
            logits = model_like.forward_unchecked(ids, None)[0, -1]
            if grammar is not None:
                logits = logits.masked_fill(~grammar.allowed(list(seq[:i])), -math.inf)
            prob *= float(warped_probs_reference(logits, params)[seq[i]])
        out[seq] = prob
    return out


def chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled; (statistic, dof)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for key, prob in expected.items():
        e, o = prob * n, counts.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return stat, cells - 1


def chi_square_limit(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at z (3.719: a false failure once in
    10,000 runs)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("blocks", ["drafts", "exact runs", "min-p"])
def test_verified_samples_follow_the_exact_distribution(model, blocks):
    """Every emitted token is distributed as sampling from the exact model: through drafts
    kept or refused by the speculative rule, or ("exact runs") through the exact steps the
    draft-length policy falls back to when drafting does not pay, several to a block;
    ("min-p") drafts again, warped by min-p instead of top-k."""
    warp = MIN_P if blocks == "min-p" else PARAMS
    engine = distorted_engine(model)
    if blocks == "exact runs":  # every block after the first token: a run of the other two
        priced_out(engine)
    runs, counts, drafted, accepted, exact_steps = 3000, {}, 0, 0, 0
    for seed in range(runs):
        params = dataclasses.replace(warp, seed=seed)
        result = engine.generate(PROMPT, NEW, mode="verified", sampling=params)
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
        drafted += result.verify.drafted_tokens
        accepted += result.verify.accepted_draft_tokens
        exact_steps += result.verify.verifier_blocks if not result.verify.drafted_tokens else 0
    if blocks == "exact runs":
        assert drafted == 0 and exact_steps == runs * (NEW - 1)
    else:
        assert drafted > 1000 and 0.2 < accepted / drafted < 0.9  # drafts kept and rejected
    exact = joint(model, warp)
    stat, dof = chi_square(counts, exact, runs)
    assert stat < chi_square_limit(dof), (stat, dof)
    # the test has power: the draft's own distribution is far outside the same bound
    draft_joint = joint(DistortedDraft(model), warp)
    expected_draft_counts = {key: prob * runs for key, prob in draft_joint.items()}
    stat_draft, _ = chi_square(expected_draft_counts, exact, runs)
    assert stat_draft > 5 * chi_square_limit(dof), stat_draft


def test_verified_sampling_reproduces_with_a_seed(model):
    engine = distorted_engine(model, block_size=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    x = torch.tensor([[1, 2, 3, 4, 0, 1, 2]])
    first = engine.generate(x, 20, mode="verified", sampling=params).tokens
    again = engine.generate(x, 20, mode="verified", sampling=params).tokens
    assert first == again and len(first) == 20
    other = engine.generate(x, 20, mode="verified",
                            sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=99)).tokens
    assert other != first


def priced_out(engine):
    """The engine's draft-length policy calibrated so that drafting never pays: every block
    is an exact run (or one exact step)."""
    k_max = engine.block_size
    engine.draft_length.calibrate({k: 100.0 * k for k in range(1, k_max + 1)},
                                  {k: 1.0 for k in range(k_max + 1)}, rewind_ms=0.0)
    return engine


@torch.inference_mode()
@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
@pytest.mark.parametrize("runs", [False, True], ids=["drafts", "exact runs"])
@pytest.mark.parametrize("stop", [None, 2])
def test_sampled_reply_leaves_the_state_of_prompt_plus_reply(model, stop, runs, held):
    """After a sampled verified reply (rejections, a stop id or the length limit; or exact runs
    with a stop inside one; ``held``: to a grammar, TwoBarred) the exact cache holds the state
    a fresh prefill of prompt + reply gives, so the next turn continues from it; a next turn
    on the kept state samples like one from scratch with the same seed."""
    engine = distorted_engine(model, block_size=4)
    if runs:
        priced_out(engine)
    params = SamplingParams(temperature=1.0, seed=5)
    x = torch.tensor([[1, 3, 2, 4, 0, 3]])
    result = engine.generate(x, 30, mode="verified", sampling=params,
                             stop_ids=[stop] if stop is not None else [],
                             constraint=TwoBarred() if held else None)
    if runs:
        assert result.verify.drafted_tokens == 0
        # (held: one step a token after the first; a plain exact run counts all its steps)
        assert result.verify.verifier_blocks == len(result.tokens) - 1 if held else \
            result.verify.verifier_blocks > 4
    else:
        assert result.verify.rejected_blocks > 0
    if stop is not None:
        assert result.stopped == "stop" and result.tokens[-1] == stop
    fresh = model.make_recurrent_cache()
    model(input_ids=torch.cat([x, torch.tensor([result.tokens])], dim=1), past_key_values=fresh)
    # (fp32 states summed in another order: ~1e-5 apart on one thread; a wrong token, O(1))
    for got, want in zip(cache_states(engine.exact_cache), cache_states(fresh), strict=True):
        assert torch.allclose(got, want, atol=1e-4)
    assert engine.exact_cache.seen_tokens == x.shape[1] + len(result.tokens)
    follow = torch.tensor([[4, 1]])
    kept = engine.generate(follow, 8, mode="verified", sampling=params, keep_state=True).tokens
    whole = torch.cat([x, torch.tensor([result.tokens]), follow], dim=1)
    fresh_engine = distorted_engine(model, block_size=4)
    if runs:
        priced_out(fresh_engine)
    scratch = fresh_engine.generate(whole, 8, mode="verified", sampling=params).tokens
    assert kept == scratch


@torch.inference_mode()
def test_a_seed_reproduces_under_the_adaptive_draft_length(model):
    """With the draft-length policy on (calibrated costs, as after the app's warm-up), the same
    seed gives the same reply again even after other replies moved the policy's running
    acceptance: where the blocks are cut decides which tokens a seed draws."""
    engine = distorted_engine(model, block_size=4)
    engine.draft_length.calibrate({k: 0.75 * k for k in range(1, 5)},
                                  {k: 1.0 + 0.04 * k for k in range(5)}, rewind_ms=0.0)
    seeded = SamplingParams(temperature=1.0, top_k=4, seed=7)
    first = engine.generate(PROMPT, 24, mode="verified", sampling=seeded).tokens
    # another reply (greedy: the distorted draft is refused often) lowers the acceptance
    engine.generate(PROMPT, 40, mode="verified")
    assert engine.draft_length.checked > 0
    assert engine.generate(PROMPT, 24, mode="verified", sampling=seeded).tokens == first


class TwoBarred:
    """A stand-in grammar over the 5-token vocabulary (structured.Constraint's interface): two
    tokens barred before each token, which two from the tokens taken so far; ``allowed`` is
    the twin's view of the same sets."""

    def __init__(self):
        self.taken, self.active = [], True

    @staticmethod
    def allowed(prefix) -> torch.Tensor:
        barred = (len(prefix) + sum(prefix)) % VOCAB
        keep = torch.ones(VOCAB, dtype=torch.bool)
        keep[[barred, (barred + 2) % VOCAB]] = False
        return keep

    def fill(self, out):
        bits = sum(1 << i for i, ok in enumerate(self.allowed(self.taken).tolist()) if ok)
        out.fill_(0)
        out[0, 0] = bits

    def accept(self, token):
        if not self.allowed(self.taken)[int(token)]:
            raise AssertionError(f"token {token} is barred after {self.taken}")
        self.taken.append(int(token))

    def rollback(self, count):
        del self.taken[len(self.taken) - count:]


@pytest.mark.parametrize("blocks", ["drafts", "exact runs"])
def test_verified_samples_under_a_grammar_follow_the_masked_exact_distribution(model, blocks):
    """A sampled verified reply held to a grammar (engine._held_verified_loop: each draft drawn
    under its mask with its masked distribution recorded, each block checked by the
    speculative rule on the masked exact distributions; or, where drafts do not pay, exact
    runs of held steps): every token is distributed as sampling from the exact model's
    logits masked by the grammar, where the masked draft's own samples are not."""
    engine = distorted_engine(model)
    if blocks == "exact runs":
        priced_out(engine)
    runs, counts, drafted, accepted = 3000, {}, 0, 0
    for seed in range(runs):
        params = dataclasses.replace(PARAMS, seed=seed)
        grammar = TwoBarred()
        result = engine.generate(PROMPT, NEW, mode="verified", sampling=params,
                                 constraint=grammar)
        assert grammar.taken == result.tokens
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
        drafted += result.verify.drafted_tokens
        accepted += result.verify.accepted_draft_tokens
    if blocks == "drafts":
        assert drafted > 1000 and 0.2 < accepted / drafted < 0.9  # drafts kept and rejected
    else:
        assert drafted == 0
    exact = joint(model, PARAMS, TwoBarred)
    stat, dof = chi_square(counts, exact, runs)
    assert stat < chi_square_limit(dof), (stat, dof)
    draft_joint = joint(DistortedDraft(model), PARAMS, TwoBarred)
    stat_draft, _ = chi_square({key: p * runs for key, p in draft_joint.items()}, exact, runs)
    assert stat_draft > 5 * chi_square_limit(dof), stat_draft
    unmasked = joint(model, PARAMS)  # (and the grammar moves the distribution)
    stat_free, _ = chi_square({key: p * runs for key, p in unmasked.items()}, exact, runs)
    assert stat_free > 5 * chi_square_limit(dof), stat_free
