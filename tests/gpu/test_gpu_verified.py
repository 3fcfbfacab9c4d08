"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): verified decoding in captured graphs (greedy and
sampled, fixed and adaptive draft lengths, the compiled verifier). A file apart from
tests/gpu/test_gpu_engine.py and tests/gpu/test_gpu_hybrid.py so that tests/gpu.sh runs them side
by side, each in a process of its own, within one device call (alone, with the hybrid and
rewind tests in it, it ran past 560 s on the H200: bench/RESULTS.md)."""

import pytest

import unimax
from helpers import gpu_model, verifier_launches
from helpers import gpu_prompt as prompt
from unimax import SamplingParams, build_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return gpu_model()


@pytest.mark.parametrize("draft", ["tail", "full"])
def test_verified_sampling_on_gpu(model, draft):
    """Speculative sampling in captured graphs (the draft's recorded distributions, the
    sampled verifier, the rewind): the eager engine's tokens for the same seed, a seed
    reproduces, and the drafts are both kept and refused. (Its distribution is tested on the
    CPU, tests/engine/test_speculative.py.)"""
    x = prompt(60, seed=5)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    graphs = build_engine(model, decode="fp8", draft=draft, block_size=8)
    graphs.capture_graphs(verified=True, sampled=True)
    eager = build_engine(model, decode="fp8", draft=draft, block_size=8, use_graphs=False)
    # A fixed draft length: which tokens a seed draws depends on the block lengths, and the
    # adaptive policy chooses them from the graphs' replay times (the eager engine has none)
    run = dict(mode="verified", sampling=params, draft_block=8)
    got = graphs.generate(x, 48, **run)
    assert got.tokens == eager.generate(x, 48, **run).tokens
    assert got.tokens == graphs.generate(x, 48, **run).tokens
    assert 0 < got.verify.accepted_draft_tokens < got.verify.drafted_tokens
    print(draft, "sampled acceptance", got.verify.acceptance_rate)
    # The adaptive policy with the graphs' costs given to both engines (the same block cuts):
    # padded short blocks and sampled exact runs in graphs draw the eager engine's tokens
    policy = graphs.draft_length
    eager.draft_length.calibrate(policy.draft_ms, policy.verify_ms, policy.rewind_ms)
    adaptive = dict(mode="verified", sampling=params)
    assert graphs.generate(x, 48, **adaptive).tokens == eager.generate(x, 48, **adaptive).tokens


def test_compiled_verifier_is_exact(model):
    """Verified mode with the fast step: compiled draft step, the verifier's full block compiled
    through the small-M linears, rejections rewound from the tape with fla's kernel: exact
    greedy decoding up to BF16 near-ties, against the one-token eager reference."""
    from unimax.reference import first_divergence, is_near_tie

    for draft in ("full", "tail"):
        x = prompt(80, seed=12)
        engine = build_engine(model, decode="fp8", draft=draft, block_size=8, compile_step=True)
        assert engine.verifier.compiled is not None
        got, report = engine.generate_verified(x, 64)
        reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), (draft, divergence)
        print(draft, "acceptance", report.acceptance_rate, "rejected",
              report.rejected_blocks)


def test_adaptive_verified_in_captured_graphs_is_exact(model, monkeypatch):
    """The app's verified mode: every graph captured up front, the draft-length policy
    calibrated from their replay times, compiled forwards: padded short blocks and exact runs
    (the full draft on random weights is poor, so the policy falls back to them) in graphs give
    the eager one-token reference's tokens up to BF16 near-ties."""
    from unimax.reference import first_divergence, is_near_tie

    x = prompt(80, seed=13)
    engine = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    engine.capture_graphs()
    assert engine.draft_length.calibrated
    launched = verifier_launches(engine, monkeypatch)
    got, report = engine.generate_verified(x, 96)
    reference = unimax.exact_greedy_tokens(model, x, 96)[0].tolist()
    divergence = first_divergence(model, x, got[0].tolist(), reference)
    assert is_near_tie(divergence), divergence
    kinds = sorted({(key[0], key[1]) for key in launched})
    print("acceptance", report.acceptance_rate, "blocks", kinds, "verify ms",
          {k: round(ms, 3) for k, ms in engine.draft_length.verify_ms.items()})
    assert set(launched) <= set(engine.verifier.runner.graphs)  # nothing captured late
