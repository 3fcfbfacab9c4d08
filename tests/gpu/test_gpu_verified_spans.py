"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): verified decoding at block_size 16, where the verifier
compiles forwards of 1, 9 and 17 rows (unimax.verifier.span_blocks). A file of its own so that
tests/gpu.sh runs it beside tests/gpu/test_gpu_verified.py: alone, cold, this test ran past
300 s on the H200 (its compiles and 16-long captures; bench/RESULTS.md),
which that file's other tests (292 s) leave no room for within one process's limit."""

import pytest

import unimax
from helpers import gpu_model, verifier_launches
from helpers import gpu_prompt as prompt
from unimax import build_engine

pytestmark = pytest.mark.gpu


def test_span_blocks_in_captured_graphs_are_exact(monkeypatch):
    """The app's verified mode at block_size 16: every graph captured up front, the
    draft-length policy calibrated from their replay times, compiled forwards of 1, 9 and 17
    rows: the adaptive length (the full draft on random weights is poor, so the policy falls
    back to exact runs) and fixed blocks of 4 and 12 drafts (padded to 9 and 17 rows), in
    graphs, give the eager one-token reference's tokens up to BF16 near-ties."""
    from unimax.reference import first_divergence, is_near_tie

    model = gpu_model()
    x = prompt(80, seed=13)
    engine = build_engine(model, decode="fp8", draft="full", block_size=16, compile_step=True)
    assert engine.verifier.span_blocks == (8, 16)
    engine.capture_graphs()
    assert engine.draft_length.calibrated
    launched = verifier_launches(engine, monkeypatch)
    reference = unimax.exact_greedy_tokens(model, x, 96)[0].tolist()
    for block in (None, 4, 12):
        got, report = engine.generate_verified(x, 96, draft_block=block)
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), (block, divergence)
        print(block, "acceptance", report.acceptance_rate, "rejected", report.rejected_blocks)
    kinds = sorted({key[:3] for key in launched if key[0] == "verify"})
    print("blocks", kinds, "verify ms",
          {k: round(ms, 3) for k, ms in engine.draft_length.verify_ms.items()})
    assert {span for _, k, span in kinds if k} == {9, 17}
    assert set(launched) <= set(engine.verifier.runner.graphs)  # nothing captured late
