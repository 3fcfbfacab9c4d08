"""The gated delta rule over a few tokens (unimax.ops.short_recurrence): our Triton kernel, in
Triton's interpreter, against fla's fused recurrent kernel (a reference we did not write) and
against the torch loop, its twin (and its rewind form: in place, the initial state kept, the
final one stored twice, no outputs; against its plain form); the op's dispatch and its errors
on the CPU."""

import pytest
import torch

from helpers import run_with_triton
from unimax.ops import short_recurrence as short
from unimax.ops.gated_delta import recurrent_gated_delta_rule_ref
from unimax.ops.short_recurrence import parse, short_gated_delta_rule

CHILD = r"""
import torch
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from unimax.ops.gated_delta import recurrent_gated_delta_rule_ref
from unimax.ops.short_recurrence import TILES, launch_short

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

torch.manual_seed(0)
# (B, T, H, HV, K, V): one chunk, a chunk and one more token (17), value heads grouped
for b, t, h, hv, k, v in [(1, 2, 2, 2, 16, 8), (1, 9, 2, 4, 32, 16), (2, 17, 1, 2, 16, 32),
                          (3, 5, 2, 2, 64, 8)]:
    for dtype in (torch.float32, torch.bfloat16):
        # the tape's layout: batch strided past T (views of a longer buffer)
        q, kk = (torch.randn(b, t + 3, h, k)[:, :t].to(dtype) for _ in range(2))
        vv = torch.randn(b, t + 3, hv, v)[:, :t].to(dtype)
        g = -torch.rand(b, t, hv) * 0.5
        beta = torch.rand(b, t, hv).to(dtype)
        h0 = torch.randn(b, hv, k, v)
        ref_o, ref_state = recurrent_gated_delta_rule_ref(q, kk, vv, g, beta, h0)
        fla_o, fla_state = fused_recurrent_gated_delta_rule(
            q=q.contiguous(), k=kk.contiguous(), v=vv.contiguous(), g=g, beta=beta,
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        for tile in (TILES[0], TILES[-1]):  # (16-token chunks at BV 4; 4-token ones at 8)
            o, state = launch_short(q, kk, vv, g, beta, h0, True, *tile)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert o.dtype == dtype and o.shape == ref_o.shape
            assert rel(o, fla_o) < tol and rel(state, fla_state) < 1e-5, (b, t, dtype, tile)
            assert rel(o, ref_o) < tol and rel(state, ref_state) < 1e-5, (b, t, dtype, tile)
            o2, none = launch_short(q, kk, vv, g, beta, h0, False, *tile)
            assert torch.equal(o2, o) and none.numel() == 0
            # the rewind's form: in place, the initial state kept, the final one stored twice
            hs, saved, copy = h0.clone(), torch.full_like(h0, 7.0), torch.zeros_like(h0)
            o3, same = launch_short(q, kk, vv, g, beta, hs, True, *tile, out=hs, save=saved,
                                    copy=copy, outputs=False)
            assert same is hs and o3.numel() == 0 and torch.equal(saved, h0)
            assert torch.equal(hs, state) and torch.equal(copy, state)
        print("ok", b, t, dtype)
# no initial state: from zeros
q, kk, vv = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 8)
g, beta = -torch.rand(1, 4, 2), torch.rand(1, 4, 2)
o, state = launch_short(q, kk, vv, g, beta, None, True, 8, 1, 16)
ref_o, ref_state = recurrent_gated_delta_rule_ref(q, kk, vv, g, beta, None)
assert rel(o, ref_o) < 1e-5 and rel(state, ref_state) < 1e-5
print("ok zero state")
"""


def test_short_kernel_matches_fla_and_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD, needs="fla")
    assert out.count("ok") == 9, out


def test_op_runs_its_twin_off_cuda():
    """On the CPU the op is the torch loop; ``final_state=False`` gives an empty tensor, as
    fla's output_final_state=False gives none."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 4, 8)
    g, beta, h0 = -torch.rand(1, 5, 4), torch.rand(1, 5, 4), torch.randn(1, 4, 8, 8)
    o, state = short_gated_delta_rule(q, k, v, g, beta, h0, True)
    ref_o, ref_state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, h0)
    assert torch.equal(o, ref_o) and torch.equal(state, ref_state)
    o, empty = short_gated_delta_rule(q, k, v, g, beta, h0, False)
    assert torch.equal(o, ref_o) and empty.numel() == 0


def test_random_run_is_the_ops_input():
    """random_run (the launch-setting timings' inputs): what the op takes, q, k and v strided
    as the tape's views where ``rows`` asks for it, g a log-decay and beta a write strength."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, state = short.random_run(3, 5, (2, 8, 4, 8), torch.bfloat16, gen, rows=9)
    assert q.shape == k.shape == (3, 5, 2, 8) and v.shape == (3, 5, 4, 8)
    assert q.stride(1) == 16 and q.stride(0) == 9 * 16 and not q.is_contiguous()
    assert g.dtype == torch.float32 and bool((g <= 0).all() and (g > -1).all())
    assert beta.dtype == torch.bfloat16 and bool((beta >= 0).all() and (beta <= 1).all())
    assert state.shape == (3, 4, 8, 8) and state.dtype == torch.float32
    o, final = short_gated_delta_rule(q, k, v, g, beta, state, True)
    assert o.shape == v.shape and final.shape == state.shape


def test_the_verifiers_choice_is_made_on_cuda_only(monkeypatch):
    """choose_for_blocks (the heads' launch setting timed at a verify block's cost) chooses
    nothing off CUDA, and a verifier built on the CPU leaves the choices as they were; a key
    already chosen keeps its choice."""
    monkeypatch.setattr(short, "CHOICES", {})
    assert short.choose_for_blocks(2, 8, 4, 8, torch.float32, 3, 9, torch.device("cpu")) is None
    from test_engine import CONFIG

    import unimax

    unimax.build_engine(unimax.GDNForCausalLM.random(CONFIG, seed=0), decode="fp8",
                        block_size=4)
    assert short.CHOICES == {}
    key = (2, 8, 4, 8, torch.float32, False)
    short.CHOICES[key] = "short@4x1x4"
    assert short.choose_for_blocks(2, 8, 4, 8, torch.float32, 3, 9,
                                   torch.device("cuda")) == "short@4x1x4"


def test_op_names_bad_input():
    q, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 3, 8)
    g = beta = torch.rand(1, 3, 3)
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of key heads"):
        short_gated_delta_rule(q, q, v, g, beta, None, False)
    q, v, g = torch.randn(1, 34, 2, 8), torch.randn(1, 34, 2, 8), torch.rand(1, 34, 2)
    with pytest.raises(ValueError, match="1 to 33 tokens, got 34"):
        short_gated_delta_rule(q, q, v, g, g, None, False)
    q, v, g = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), torch.rand(1, 3, 2)
    with pytest.raises(ValueError, match="initial_state must be contiguous fp32"):
        short_gated_delta_rule(q, q, v, g, g, torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16),
                               True)
    with pytest.raises(ValueError, match="kernel must be 'fla' or one of short@"):
        parse("short@3x1")


def test_op_traces_with_no_graph_break():
    """Its fake kernel: a compiled forward calls it as one opaque op."""
    q, v, g = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), -torch.rand(1, 3, 2)
    h0 = torch.randn(1, 2, 8, 8)
    traced = torch.compile(lambda q, v: short_gated_delta_rule(q, q, v, g, g.neg(), h0,
                                                               True)[0] * 2,
                           fullgraph=True, backend="eager")
    ref, _ = recurrent_gated_delta_rule_ref(q, q, v, g, g.neg(), h0)
    assert torch.allclose(traced(q, v), 2 * ref)


@pytest.mark.parametrize("final", [True, False])
def test_op_passes_opcheck(final):
    """Schema, fake kernel (shapes and strides as the real op returns them) and compiled
    dispatch: torch.library.opcheck, with strided inputs as the tape hands them."""
    q, k = torch.randn(1, 7, 2, 8)[:, :5], torch.randn(1, 5, 2, 8)
    v, g = torch.randn(1, 5, 4, 8), -torch.rand(1, 5, 4)
    torch.library.opcheck(short_gated_delta_rule, (q, k, v, g, g.neg(), torch.randn(1, 4, 8, 8),
                                                   final))


def test_one_choice_for_every_length_batch_and_final_flag(monkeypatch):
    """The verify block (1 sequence, k + 1 tokens, no final state) and the rewinds (every layer
    as the batch, any span, the final state) ask for one kernel choice: a state must round
    alike whichever block boundary it was computed across (ops.short_recurrence's docstring).
    The choice is asked for once per heads, and kept when first met in a capture."""
    asked = []

    def timed_choice(table, key, names, default, on_cuda, run, tensors, keep_default=False):
        asked.append((key, default, keep_default))
        table[key] = "short@4x1x8"
        return table[key]

    monkeypatch.setattr(short, "timed_choice", timed_choice)
    monkeypatch.setattr(short, "CHOICES", {})
    for batch, tokens, final in ((1, 9, False), (32, 9, True), (32, 3, True), (1, 33, False)):
        q = torch.zeros(batch, tokens, 2, 8)
        v = torch.zeros(batch, tokens, 4, 8)
        g = torch.zeros(batch, tokens, 4)
        state = torch.zeros(batch, 4, 8, 8)
        assert short.choose(q, q, v, g, g, state, final) == "short@4x1x8"
    assert asked == [((2, 8, 4, 8, torch.float32, False), short.DEFAULT, True)]
    for tile in (short.parse(name) for name in short.names()[1:]):  # the chunk: the setting's
        assert {short.constants(tile, t, 128, 128)["TC"]
                for t in range(1, short.SHORT_MAX + 1)} == {tile[2]}
