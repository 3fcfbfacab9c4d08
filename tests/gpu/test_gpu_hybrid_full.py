"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): a hybrid model's verified decoding with the full-FP8
draft, captured graphs against eager. A file of its own, split from tests/gpu/test_gpu_hybrid.py
(that test took 487 s of a process's 560 with both drafts), so that
tests/gpu.sh runs it side by side."""

import pytest
from test_gpu_hybrid import assert_verified_graphs_match_eager, hybrid_model

pytestmark = pytest.mark.gpu


def test_hybrid_full_draft_graphs_on_gpu(tmp_path):
    """The full-FP8 draft's verified decoding on a hybrid: the captured verifier and draft
    graphs give the eager engine's tokens (KV rolled back by position, GDN states rewound)."""
    model, x = hybrid_model(tmp_path)
    assert_verified_graphs_match_eager(model, x, "full")
