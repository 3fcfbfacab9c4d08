"""The verify block's gated norm as its out-projection's prologue (unimax.ops.gemv_gated)
against its twin, on the CPU through Triton's interpreter (a child process); the op's CPU path,
its bad input, its fake kernel; a view's mixers. (Its sm_90 / sm_89 compile: test_gemv.py.)"""

import pytest
import torch

from helpers import run_with_triton
from unimax.ops.gemv_gated import check, gated_linear_ref, gemv_gated, names, small_m_gated_linear

CHILD = """
import torch
from unimax.ops.gemv_gated import gated_linear_ref, gemv_gated, names
from unimax.norms import gated_rms_norm_ref

def trunc(t):
    # Triton's interpreter turns fp32 into BF16 by dropping bits, where a GPU rounds to
    # nearest: its twin rounds so
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

def trunc_twin(x, z, nw, eps, act, w):
    m, k = x.shape
    d = nw.shape[0]
    h = x.float().reshape(m, k // d, d)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * nw.float()
    g = z.float().reshape(m, k // d, d)
    y = y * (torch.nn.functional.silu(g) if act == "silu" else torch.sigmoid(g))
    return trunc(trunc(y.reshape(m, k)).float() @ w.float().t())

torch.manual_seed(0)
for m, heads, d, n, act in ((9, 4, 64, 70, "silu"), (17, 8, 128, 40, "sigmoid"),
                            (5, 16, 64, 33, "silu")):
    k = heads * d
    x = torch.randn(m, k).to(torch.bfloat16)
    z = (2 * torch.randn(m, k)).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(d)).to(torch.bfloat16)
    w = (torch.randn(n, k) / 10).to(torch.bfloat16)
    r, t = gated_linear_ref(x, z, nw, 1e-6, act, w), trunc_twin(x, z, nw, 1e-6, act, w)
    offered = names(m, n, k, d)
    picked = [offered[0], offered[-1]] + [x for x in offered if x.startswith("dotsplit")][:1]
    for name in picked:
        y = gemv_gated(x, z, nw, 1e-6, act, w, None, name)
        assert y.shape == r.shape == (m, n) and y.dtype == torch.bfloat16
        err = float((y.float() - r.float()).norm() / r.float().norm())
        off = float((y != t).float().mean())
        print("case", m, k, act, name, f"{err:.2e}", f"{off:.4f}")
"""


def test_gated_linear_matches_its_twin_in_the_interpreter():
    """Every case at its first and last offered tile, and split-K where offered (K of 1024):
    close to the twin (round to nearest), and against the interpreter's truncating twin only
    the elements where the fp32 sums' order lands on the other side of a rounding."""
    out = run_with_triton(CHILD)
    rows = [line.split() for line in out.strip().splitlines() if line.startswith("case")]
    assert len(rows) >= 7 and any("dotsplit" in row[4] for row in rows), out
    for _, m, k, act, name, err, off in rows:
        assert float(err) < 2e-2, (m, k, act, name, err)
        assert float(off) < 0.02, (m, k, act, name, off)


def test_names_hold_whole_heads():
    """Only tiles whose K step holds whole heads are offered; split-K where it fits."""
    dot_only = names(9, 70, 512, 128)
    assert dot_only and all(n.startswith("dot@") for n in dot_only)
    assert all(int(n.split("@")[1].split("x")[1]) % 128 == 0 for n in dot_only)
    assert any(n.startswith("dotsplit@") for n in names(9, 2560, 4096, 128))
    assert all(int(n.split("@")[1].split("x")[1]) % 512 == 0 for n in names(9, 70, 4096, 512))
    assert names(9, 70, 2048, 1024) == ()  # (no K step holds a head of 1024)


def test_op_on_cpu_is_the_twin_and_traces():
    """Off CUDA the op computes the twin, which is the mixer's own gated norm then the
    product; the fake kernel lets a compiled function trace through it (no graph break)."""
    from unimax.norms import GatedRMSNorm

    gen = torch.Generator().manual_seed(3)
    x, z = (torch.randn(9, 4 * 32, generator=gen).bfloat16() for _ in range(2))
    norm = GatedRMSNorm(32, 1e-6, "silu")
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
    w = torch.randn(50, 128, generator=gen).bfloat16()
    got = small_m_gated_linear(x, z, norm.weight.detach(), w, 1e-6, "silu")
    assert torch.equal(got, gated_linear_ref(x, z, norm.weight.detach(), 1e-6, "silu", w))
    normed = norm(x.reshape(9, 4, 32), z.reshape(9, 4, 32)).reshape(9, 128).detach()
    want = (normed.float() @ w.float().t()).bfloat16()
    assert torch.equal(got, want)
    traced = torch.compile(lambda *a: small_m_gated_linear(*a, 1e-6, "silu") * 2,
                           fullgraph=True, backend="eager")
    assert torch.equal(traced(x, z, norm.weight.detach(), w), 2 * got)


def test_gated_linear_names_bad_input():
    x, z, nw, w = torch.randn(9, 128), torch.randn(9, 128), torch.ones(32), torch.randn(5, 128)
    with pytest.raises(ValueError, match="must both be"):
        check(x, z[:, :64], nw, "silu", w)
    with pytest.raises(ValueError, match="one head's"):
        check(x, z, torch.ones(48), "silu", w)
    with pytest.raises(ValueError, match="silu or sigmoid"):
        check(x, z, nw, "gelu", w)
    with pytest.raises(ValueError, match="at most 32 rows"):
        check(torch.randn(33, 128), torch.randn(33, 128), nw, "silu", w)
    with pytest.raises(ValueError, match="whole heads"):
        gemv_gated(x, z, torch.ones(64), 1e-6, "silu", w, None, "dot")


def test_verifier_view_marks_its_gdn_mixers():
    """gemv_view sets gated_out_op on its own mixers' copies, never on the exact model's; the
    op is off by default, and on CPU the mixer keeps the torch forms either way."""
    from unimax import GDNForCausalLM
    from unimax.fast_step import gemv_view
    from unimax.ops import gemv_gated as op
    from unimax.tiny import TINY_CONFIG

    model = GDNForCausalLM.random(TINY_CONFIG, seed=1)
    view = gemv_view(model, fuse=False)
    assert all(block.mixer.gated_out_op for block in view.layers)
    assert not any(block.mixer.gated_out_op for block in model.layers)
    assert op.GATED_PROLOGUE is False
    o = torch.randn(1, 9, TINY_CONFIG.num_v_heads, TINY_CONFIG.head_v_dim)
    assert not view.layers[0].mixer._gated_op(o, 9)  # (CPU)


def test_compiled_verifier_with_the_op_decodes_exact_greedy(pure_or_hybrid, monkeypatch):
    """The verifier's view compiled (inductor's CPU backend, as on a GPU) with the op taking
    its blocks' gated norms (forced on here: on CUDA only it would): every block of 9 rows
    runs it, no graph break, and fixed and adaptive blocks decode exactly the exact model's
    greedy tokens, rejections included."""
    from test_engine import ErringDraft

    import unimax
    from unimax.layers import GatedDeltaNetMixer
    from unimax.ops import gemv_gated as op

    model = pure_or_hybrid
    rows = []

    def gated(x, *args):
        rows.append(x.shape[0])
        return small_m_gated_linear(x, *args)

    monkeypatch.setattr(op, "small_m_gated_linear", gated)
    monkeypatch.setattr(GatedDeltaNetMixer, "_gated_op",
                        lambda self, o, n: self.gated_out_op and 4 < n <= 32)
    # traced afresh: dynamo's guards on an earlier test's compiled view of the same model do
    # not cover the patched method, so it would replay that compile without the op
    torch._dynamo.reset()
    draft = ErringDraft(model, period=3)
    engine = unimax.UniMaxEngine(model, draft, unimax.MaxTurboGraphDecoder(draft, 8),
                                 compile_verifier=True)
    x = torch.randint(0, model.config.vocab_size, (1, 9),
                      generator=torch.Generator().manual_seed(4))
    reference = unimax.exact_greedy_tokens(model, x, 30)
    rejected = 0
    for block in (8, 3, None):
        got, report = engine.generate_verified(x, 30, draft_block=block)
        assert torch.equal(got, reference), block
        rejected += report.rejected_blocks
    assert rejected and set(rows) == {9}
