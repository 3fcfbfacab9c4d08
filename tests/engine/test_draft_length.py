"""The draft-length policy of verified mode: its expected-throughput model against a simulation,
its choices at high and low acceptance, probing, and an engine that drafts by it still emitting
exactly the exact model's greedy tokens."""

import random

import pytest
import torch
from test_engine import erring_engine, prompt

import unimax
from helpers import rel_err, verifier_launches
from unimax.draft_length import DraftLength

# Costs shaped like the H200's 4B row (bench/RESULTS.md), in BF16 steps: a draft step 0.75, the
# verifier 1.0 + 0.04 per draft, a rewind 0.05.
K = 8
DRAFT = {k: 0.75 * k for k in range(1, K + 1)}
VERIFY = {k: 1.0 + 0.04 * k for k in range(K + 1)}


def policy(**kw) -> DraftLength:
    p = DraftLength(K, host_ms=0.0, **kw)
    p.calibrate(DRAFT, VERIFY, rewind_ms=0.05)
    return p


def simulate(p: DraftLength, k: int, a: float, blocks: int = 40000) -> float:
    """Tokens per ms of fixed-k blocks whose drafts agree with probability a each."""
    rng = random.Random(0)
    tokens = ms = 0.0
    for _ in range(blocks):
        m = 0
        while m < k and rng.random() < a:
            m += 1
        tokens += m + 1
        ms += DRAFT.get(k, 0.0) + VERIFY[k] + (0.05 if m < k else 0.0)
    return tokens / ms


@pytest.mark.parametrize("a", [0.3, 0.8, 0.97])
@pytest.mark.parametrize("k", [0, 3, 8])
def test_expected_throughput_matches_a_simulation(k, a):
    p = policy()
    model = p.expected_tokens(k, a) / p.expected_ms(k, a)
    assert model == pytest.approx(simulate(p, k, a), rel=0.02)


@pytest.mark.parametrize("a", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_adaptive_throughput_is_near_the_best_fixed_length(a):
    """Drafts that agree with probability a each: the policy, learning a as it goes, gets within
    3% of the best fixed draft length for that a (which it does not know)."""
    p, rng, tokens, ms = policy(), random.Random(1), 0.0, 0.0
    for _ in range(20000):
        k = p.choose(1000)
        m = 0
        while m < k and rng.random() < a:
            m += 1
        p.observe(k, m)
        tokens += m + 1
        ms += DRAFT.get(k, 0.0) + VERIFY[k] + (0.05 if m < k else 0.0)
    best_fixed = max(simulate(p, k, a, 20000) for k in range(K + 1))
    assert tokens / ms >= 0.97 * best_fixed


def test_uncalibrated_drafts_the_longest_block_that_fits():
    p = DraftLength(K)
    assert not p.calibrated
    assert p.choose(100) == K and p.choose(5) == 4 and p.choose(1) == 0


def test_learns_high_and_low_acceptance():
    p = policy()
    for _ in range(50):
        p.observe(K, K)
    high = p.acceptance
    assert high > 0.95 and p.choose(100) >= 4
    for _ in range(50):
        p.observe(K, 0)
    assert p.acceptance < 0.3 and p.choose(100) == 0
    # each choice is the best length of a simulation at the estimated acceptance
    for a in (high, p.acceptance):
        rates = [simulate(p, k, a, 20000) for k in range(K + 1)]
        assert rates[p.best(K, a)] >= max(rates) * 0.99


def test_probes_after_a_run_of_exact_steps_and_recovers():
    p = policy(probe_every=5)
    for _ in range(50):
        p.observe(K, 0)
    ks = []
    for _ in range(15):  # drafts still poor: every probe fails
        ks.append(p.choose(100))
        p.observe(ks[-1], 0)
    # a one-token probe after five blocks; it fails, so the next waits ten
    assert ks == [0] * 4 + [1] + [0] * 9 + [1], ks
    assert p.gap == 20
    ks = []
    for _ in range(60):  # the drafts got good: every draft is accepted
        ks.append(p.choose(100))
        p.observe(ks[-1], ks[-1])
    # a probe, then probes twice as long while they pass, then the policy's own choice
    assert ks[:22] == [0] * 19 + [1, 2, 4], ks
    assert min(ks[22:]) >= 1 and ks[-1] >= 3, ks
    assert p.gap == 5  # drafting of its own accord: probes every five blocks again


def test_failed_probes_space_out_the_next_up_to_a_cap():
    """Poor drafts: each failed probe doubles the run of exact steps before the next, up to
    probe_every_max, so a reply whose drafts never agree pays one draft step per ever longer
    run (simulated at the H200's Qwen3.5-0.8B costs, bench/RESULTS.md:
    0.897 -> 0.949x BF16-only at acceptance 0.8). forget() starts over."""
    p = policy(probe_every=4, probe_every_max=32)
    for _ in range(50):
        p.observe(K, 0)
    probes = []
    for step in range(200):
        k = p.choose(1000)
        if k:
            probes.append(step)
        p.observe(k, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {32}, gaps
    p.forget()
    assert p.gap == 4
    with pytest.raises(ValueError, match="probe_every"):
        DraftLength(K, probe_every=64, probe_every_max=32)


def test_a_replys_last_token_does_not_restart_the_count_to_a_probe():
    """Where only k = 0 fits (a reply's last token) nothing is chosen: the run of exact steps
    counts on, so replies shorter than probe_every still meet their probes."""
    p = policy(probe_every=5)
    for _ in range(50):
        p.observe(K, 0)
    ks = []
    for remaining in (100, 100, 1, 100, 100, 100, 100):  # (a reply ends after two steps)
        ks.append(p.choose(remaining))
        p.observe(ks[-1], 0)
    assert ks == [0, 0, 0, 0, 0, 1, 0], ks


def test_a_fresh_policy_drafts_from_its_first_block():
    """At the H200's measured 4B costs in BF16 steps (bench/RESULTS.md: draft
    step 0.655, a padded verify 1.25 for every k >= 1, an exact step through the verifier 1.02),
    the prior alone makes the first block draft, so good drafts are in use from the start of a
    reply instead of after the first probe, 32 exact steps in; poor ones cost that one block."""
    p = DraftLength(K, host_ms=0.03)
    p.calibrate({k: 0.655 * k for k in range(1, K + 1)},
                {0: 1.02, **{k: 1.25 for k in range(1, K + 1)}}, rewind_ms=0.0)
    assert p.choose(100) >= 2
    for _ in range(4):
        p.observe(p.choose(100), 0)
    assert p.choose(100) == 0
    p.forget()
    assert p.choose(100) >= 2


def test_an_exact_run_is_the_k0_blocks_chosen_one_by_one():
    """Poor drafts: choosing block by block and choosing exact runs (up to 8 steps, each
    observed as a k = 0 block) give the same draft length at every step, probes included."""
    def trained():
        p = policy(probe_every=11)
        for _ in range(50):
            p.observe(K, 0)
        return p

    one, runs = trained(), trained()
    by_block = []
    for _ in range(60):
        by_block.append(one.choose(1000))
        one.observe(by_block[-1], 0)
    by_run = []
    while len(by_run) < 60:
        k = runs.choose(1000)
        steps = runs.exact_run(8) if k == 0 and not runs.probe else 1
        for _ in range(steps):
            runs.observe(k, 0)
        by_run += [k] * steps
    assert by_run[:60] == by_block
    assert [i for i, k in enumerate(by_block) if k] == [10, 32]  # after 11 blocks, then 22


def test_exact_runs_pay_a_share_of_the_host_cost():
    """k = 0 runs as exact runs (up to k_max steps, one host sync), so a step's share of the
    host cost is host_ms / k_max. At the H200's measured gdn24-0.8b costs (ms)
    exact runs win at acceptance 0.95 and drafting at 1.0; at its 4B costs drafting
    wins at 0.95 too. (Charged the whole host cost per step, the 0.8B policy drafted 4 at
    0.95, where it measured 0.95x BF16-only.)"""
    small = DraftLength(K, host_ms=0.1)
    small.calibrate({k: 0.614 * k for k in range(1, K + 1)},
                    {0: 0.7556, **{k: 1.236 + 0.0025 * k for k in range(1, K + 1)}}, 0.0)
    assert small.expected_ms(0, 0.95) == pytest.approx(0.7556 + 0.1 / K)
    assert small.expected_ms(4, 0.95) == pytest.approx(4 * 0.614 + 1.246 + 0.1)
    assert small.best(K, 0.95) == 0
    assert small.best(K, 1.0) == K
    large = DraftLength(K, host_ms=0.1)
    large.calibrate({k: 1.685 * k for k in range(1, K + 1)},
                    {0: 2.668, **{k: 3.25 + 0.01 * k for k in range(1, K + 1)}}, 0.12)
    assert large.best(K, 0.95) > 0


def test_a_held_replys_host_turns_price_its_drafts():
    """A reply held to a grammar pays a host sync per draft that the graphs' costs do not hold
    (Qwen3.5-0.8B on an H100: drafted 802 tok/s, exact steps 977). Priced
    per draft (``extra``, unimax.held.HostTurns), it tips the choice to exact steps where it
    costs more than the drafts save, and not where it is small; k = 0 pays the per-step one."""
    from unimax.held import HostTurns

    p = policy()
    assert p.best(K, 1.0) == K
    assert p.best(K, 1.0, extra=HostTurns(draft_ms=0.05)) == K
    assert p.best(K, 1.0, extra=HostTurns(draft_ms=1.0)) == 0
    turns = HostTurns(draft_ms=0.3, step_ms=0.2)
    assert p.expected_ms(4, 1.0, turns) == pytest.approx(p.expected_ms(4, 1.0) + 1.2)
    assert p.expected_ms(0, 1.0, turns) == pytest.approx(p.expected_ms(0, 1.0) + 0.2)
    # choose takes it too, and learns nothing from it
    assert p.choose(100, extra=HostTurns(draft_ms=1.0)) == 0
    assert p.choose(100) == p.best(K) > 0


def test_host_turns_are_a_running_mean_of_what_the_graphs_do_not_hold():
    from unimax.held import HostTurns

    turns = HostTurns(weight=0.5)
    turns.observe(4, 4, wall_ms=6.0, graphs_ms=4.0)  # 0.5 ms a draft
    assert (turns.draft_ms, turns.step_ms) == (0.25, 0.0)
    turns.observe(4, 4, wall_ms=6.0, graphs_ms=4.0)
    assert turns.draft_ms == pytest.approx(0.375)
    turns.observe(0, 3, wall_ms=3.3, graphs_ms=3.0)  # an exact run: 0.1 ms a step
    assert turns.step_ms == pytest.approx(0.05) and turns.draft_ms == pytest.approx(0.375)
    turns.observe(2, 2, wall_ms=1.0, graphs_ms=3.0)  # faster than its graphs: counts as 0
    assert turns.draft_ms == pytest.approx(0.1875)
    assert turns(3) == pytest.approx(3 * 0.1875) and turns(0) == pytest.approx(0.05)
    fixed = HostTurns(draft_ms=2.0, learn=False)
    fixed.observe(1, 1, wall_ms=9.0, graphs_ms=1.0)
    assert fixed.draft_ms == 2.0


def test_observe_checks_its_input():
    with pytest.raises(ValueError, match="accepted must be in 0..3"):
        policy().observe(3, 4)
    with pytest.raises(ValueError, match="k_max must be an integer >= 1"):
        DraftLength(0)


@torch.inference_mode()
@pytest.mark.parametrize("period", [2, 50])
def test_engine_with_the_policy_is_exact(model, period):
    """A draft that errs every 2nd step (the policy falls back to exact steps) or rarely (it
    drafts long blocks): the tokens are the exact greedy ones either way, on pure and hybrid
    models (whose verifier graphs are keyed by KV bucket too)."""
    engine = erring_engine(model, block_size=K, period=period)
    engine.draft_length.calibrate(DRAFT, VERIFY, rewind_ms=0.05)
    x = prompt(9, seed=4) % model.config.vocab_size
    got, report = engine.generate_verified(x, 60)
    assert torch.equal(got, unimax.exact_greedy_tokens(model, x, 60))
    lengths = report.drafted_tokens / report.verifier_blocks
    if period == 2:  # mostly exact steps, a probe now and then
        assert lengths < 1.0
        assert report.verifier_blocks > report.generated_tokens / 2  # runs count per step
    else:
        assert lengths > 2.0 and engine.draft_length.acceptance > 0.9


@pytest.fixture(scope="module")
def model(pure_or_hybrid):
    return pure_or_hybrid


def test_engine_calibrates_from_its_graph_timings(model):
    """The policy's costs are the captured graphs' replay times: draft blocks per k, greedy
    verify graphs (which include the rollback) of the span a reply meets, averaged over KV
    buckets, sampled and unpadded ones ignored; k = 0 per step of the full exact runs, how the
    engine runs those blocks (the single step's block until they are captured); with a draft
    block missing it stays uncalibrated."""
    engine = erring_engine(model, block_size=3)
    decoded = engine.decode_graph.runner.replay_ms
    checked = engine.verifier.runner.replay_ms
    decoded.update({(k, False): 0.7 * k for k in (1, 2)})
    decoded.update({(k, True): 9.0 for k in (1, 2, 3)})
    span = engine.verifier.span
    assert [span(k, 0) for k in range(4)] == [1, 4, 4, 4]  # padded to the full block
    checked.update({("verify", k, span(k, 0), w): 1.0 + 0.1 * k + (0.2 if w == 512 else 0.0)
                    for k in range(4) for w in (256, 512)})
    checked.update({("verify", k, span(k, 0), 256, "sampled"): 50.0 for k in range(4)})
    # unpadded blocks (only where the buffers' end leaves no room) are not what replies meet
    checked.update({("verify", k, k + 1, 512): 70.0 for k in (1, 2)})
    engine._calibrate_draft_length()
    assert not engine.draft_length.calibrated  # no (3, False) block yet
    decoded[(3, False)] = 2.1
    engine._calibrate_draft_length()
    policy = engine.draft_length
    assert policy.calibrated
    assert policy.draft_ms == {0: 0.0, 1: 0.7, 2: 1.4, 3: 2.1}
    assert policy.verify_ms[2] == pytest.approx(1.3)  # (1.2 + 1.4) / 2, sampled left out
    assert policy.verify_ms[1] == pytest.approx(1.2)  # the padded graphs, not the unpadded
    assert policy.verify_ms[0] == pytest.approx(1.1)  # no exact run captured: one step's block
    assert policy.rewind_ms == 0.0
    # exact runs of block_size steps, per step, the mean over buckets; shorter runs and sampled
    # ones left out
    checked.update({("exact", 3, 256): 3 * 0.8, ("exact", 3, 512): 3 * 0.9,
                    ("exact", 2, 256): 2 * 0.1, ("exact", 3, 256, "sampled"): 0.3})
    engine._calibrate_draft_length()
    assert policy.verify_ms[0] == pytest.approx(0.85)
    assert policy.verify_ms[1] == pytest.approx(1.2)


@torch.inference_mode()
def test_exact_runs_with_a_stop_inside_keep_the_conversation_exact(model, monkeypatch):
    """Poor drafts: the exact steps run several to a graph (one host sync per run); a stop
    token inside a run ends the reply there, and the next turn continues from exactly prompt +
    reply, on pure and hybrid models."""
    from test_engine import fresh_state

    engine = erring_engine(model, block_size=K, period=2)
    engine.draft_length.calibrate(DRAFT, VERIFY, rewind_ms=0.05)
    keys = verifier_launches(engine, monkeypatch)
    x = prompt(11, seed=8) % model.config.vocab_size
    reference = unimax.exact_greedy_tokens(model, x, 50)[0].tolist()
    blocks = []
    assert engine.generate(x, 50, mode="verified", on_block=blocks.append).tokens == reference
    assert max(key[1] for key in keys if key[0] == "exact") == K  # runs of up to a block
    # a stop id inside a run after other runs: a token it emitted after its first, first
    # seen there
    assert blocks[0] == reference[:1]  # the prefill's token, then one block per launch
    start, inside = 1, []
    for key, block in zip(keys, blocks[1:], strict=True):
        if key[0] == "exact":
            inside += [start + i for i in range(1, len(block) - 1)
                       if reference.index(block[i]) == start + i]
        start += len(block)
    assert [key[0] for key in keys].count("exact") >= 3 and inside
    stop_at = inside[-1]
    engine.reset()
    engine.draft_length.forget()
    keys.clear()
    result = engine.generate(x, 50, mode="verified", stop_ids=[reference[stop_at]])
    assert result.tokens == reference[:stop_at + 1] and result.stopped == "stop"
    assert keys[-1][0] == "exact"  # the reply's last block: a run, cut by the stop
    history = torch.cat([x, torch.tensor([result.tokens])], dim=1)
    expected = fresh_state(model, history)
    assert engine.exact_cache.seen_tokens == expected.seen_tokens
    for a, b in zip(engine.exact_cache.layers, expected.layers, strict=True):
        if hasattr(a, "recurrent_states"):
            assert rel_err(a.recurrent_states[0], b.recurrent_states[0]) < 1e-5
    turn2 = prompt(5, seed=9) % model.config.vocab_size
    second = engine.generate(turn2, 12, mode="verified", keep_state=True)
    assert second.tokens == unimax.exact_greedy_tokens(
        model, torch.cat([history, turn2], dim=1), 12)[0].tolist()
