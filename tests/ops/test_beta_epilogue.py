"""The in-projection's beta epilogue (unimax.ops.in_proj_conv with beta_heads, the fused GEMV's
``BETA``): the b channels stored as the mixer's rounded write strength, sigmoid(b) rounded to
the activation dtype (doubled with negative eigenvalues), in Triton's interpreter against a
twin that rounds as the interpreter does; the op's twin and its bad input; and the verifier's
view, whose one-token steps take it (the draft and BF16-only do not)."""

import pytest
import torch

import unimax.fused_draft as fused_draft
from helpers import kernels_for_test, run_with_triton
from unimax import kernels
from unimax.ops.decode_step import write_strength
from unimax.ops.in_proj_conv import fused_in_proj_conv

# C convolved channels, then z (Z), then b and a (H each): b spans two 16-row tiles
C, Z, H, K = 64, 44, 32, 256
N = C + Z + 2 * H

CHILD = f"""
import torch
from unimax.fp8 import quantize_rows
from unimax.ops.fused_gemv import fused_gemv

def trunc(t):
    # Triton's interpreter turns fp32 into BF16 by dropping bits, where a GPU rounds to
    # nearest: the twin rounds so, to check each element
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

def ulps(a, b):
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())

torch.manual_seed(0)
C, Z, H, K, N = {C}, {Z}, {H}, {K}, {N}
w = torch.randn(N + 5, K + 16)
q, s = quantize_rows(w)
x = (3 * torch.randn(1, K)).to(torch.bfloat16)
norm = 1 + 0.1 * torch.randn(K)
conv_w = torch.randn(C, 4)
state = torch.randn(1, C, 4).to(torch.bfloat16)
for kernel, weight, scale in (("rows", q, s), ("rows16@16x256x4", q, s), ("split", q, s),
                              ("tma@16x256x4x4", w.to(torch.bfloat16), None)):
    for double in (False, True):
        plain_state, beta_state = state.clone(), state.clone()
        args = (x, weight, scale, N, K, "rms", norm)
        kw = dict(eps=1e-6, offset=1.0, kernel=kernel, conv_weight=conv_w)
        plain = fused_gemv(*args, conv_state=plain_state, **kw)
        got = fused_gemv(*args, conv_state=beta_state, beta=(C + Z, H, double), **kw)
        b = plain[:, C + Z:C + Z + H].float()  # (the kernel's own b, rounded as it rounds)
        want = trunc(1.0 / (1.0 + torch.exp(-b)))
        if double:
            want = trunc(want.float() * 2.0)
        beta = got[:, C + Z:C + Z + H]
        rest = torch.equal(got[:, :C + Z], plain[:, :C + Z]) and torch.equal(
            got[:, C + Z + H:], plain[:, C + Z + H:]) and torch.equal(beta_state, plain_state)
        # (off the unrounded b: the sigmoid of the sums before they were rounded)
        print(kernel, double, int(rest), int((beta != want).sum()), ulps(beta, want),
              int(torch.equal(beta, b.to(torch.bfloat16))))
"""


def test_beta_epilogue_matches_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 8, out
    for kernel, double, rest, off, ulps, unchanged in rows:
        assert rest == "1", (kernel, double, out)  # every other output and the windows as
        # without beta, bit for bit
        assert int(off) == 0 and int(ulps) == 0, (kernel, double, out)
        assert unchanged == "0", (kernel, double, out)  # (b itself was replaced)


def inputs(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen).to(dtype)
    x = (3 * torch.randn(1, K, generator=gen)).to(dtype)
    norm = 1 + 0.1 * torch.randn(K, generator=gen)
    conv_w = torch.randn(C, 4, generator=gen)
    state = torch.randn(1, C, 4, generator=gen).to(dtype)
    return x, w, norm, conv_w, state


@pytest.mark.parametrize("double", [False, True])
def test_the_ops_twin_rounds_beta_as_the_mixer_does(double):
    """Off CUDA the op is its twin: the projection and convolution as without beta_heads, and
    the b channels the mixer's write_strength of them (BF16: sigmoid rounded, doubled)."""
    x, w, norm, conv_w, state = inputs()
    plain_state, beta_state = state.clone(), state.clone()
    plain = fused_in_proj_conv(x, w, None, N, K, norm, 1e-6, 1.0, plain_state, conv_w)
    got = fused_in_proj_conv(x, w, None, N, K, norm, 1e-6, 1.0, beta_state, conv_w,
                             C + Z, H, double)
    b = slice(C + Z, C + Z + H)
    assert torch.equal(got[:, b], write_strength(plain[:, b], double))
    assert not torch.equal(got[:, b], plain[:, b])
    keep = torch.ones(N, dtype=torch.bool)
    keep[b] = False
    assert torch.equal(got[:, keep], plain[:, keep]) and torch.equal(beta_state, plain_state)


def test_beta_channels_that_do_not_fit_are_named():
    x, w, norm, conv_w, state = inputs()
    for start, heads in ((C - 1, H), (N - H + 1, H)):  # over the conv's channels, past N
        with pytest.raises(ValueError, match=f"the b channels {start} .. {start + heads - 1} "
                                             f"must lie past the {C} convolved channels and "
                                             f"inside the {N} outputs"):
            fused_in_proj_conv(x, w, None, N, K, norm, 1e-6, 1.0, state, conv_w, start, heads)
    from unimax.ops.fused_gemv import fused_gemv
    with pytest.raises(ValueError, match=f"beta channels {N - 2} .. {N + 1} must lie within "
                                         f"the {N} outputs"):
        fused_gemv(x, w, None, N, K, "rms", norm, conv_state=state, conv_weight=conv_w,
                   beta=(N - 2, 4, False))


def test_the_op_traces_without_a_graph_break():
    x, w, norm, conv_w, state = inputs()
    traced = torch.compile(lambda x: fused_in_proj_conv(x, w, None, N, K, norm, 1e-6, 1.0,
                                                        state.clone(), conv_w, C + Z, H) * 2,
                           fullgraph=True, backend="eager")
    want = fused_in_proj_conv(x, w, None, N, K, norm, 1e-6, 1.0, state.clone(), conv_w, C + Z,
                              H)
    assert torch.equal(traced(x), want * 2)


def test_only_the_verifiers_view_takes_beta_in_the_epilogue(monkeypatch):
    """The verifier's view (unimax.verifier.exact_view) asks the in-projection for beta (its
    b channels at conv_dim + value_dim, the value heads' count) and hands it on to the recurrence as
    it is (``beta_done``), with the kernel configuration's fold_beta; BF16-only's fast step never
    (it takes sigmoid(b) inside the recurrence's kernel). Without it no view asks, and the verifier
    view's one-token logits and states are the same bit for bit (BF16, on the CPU:
    the twin)."""
    from helpers import cache_states
    from unimax import GDNForCausalLM
    from unimax.fast_step import gemv_view
    from unimax.tiny import TINY_CONFIG
    from unimax.verifier import exact_view

    model = GDNForCausalLM.random(TINY_CONFIG, dtype=torch.bfloat16, seed=0)
    cfg = model.config
    calls = []
    real = fused_draft.fused_in_proj_conv

    def spy(x, *args):
        calls.append(args[9:])
        return real(x, *args)

    monkeypatch.setattr(fused_draft, "fused_in_proj_conv", spy)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, 6), generator=gen)
    step = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)

    def one_step(view):
        calls.clear()
        with torch.inference_mode():
            cache = view.make_recurrent_cache()
            view(input_ids=prompt, past_key_values=cache, use_cache=True)
            return view.forward_unchecked(step, cache), cache_states(cache), list(calls)

    start, heads = cfg.conv_dim + cfg.value_dim, cfg.num_v_heads
    gdn = sum(not cfg.is_attention(i) for i in range(cfg.num_hidden_layers))
    assert gdn and kernels.active().fold_beta
    logits, states, view_calls = one_step(exact_view(model))
    assert view_calls == [(start, heads, cfg.allow_neg_eigval)] * gdn
    assert one_step(gemv_view(model, fuse=True))[2] == [(start, 0, cfg.allow_neg_eigval)] * gdn
    kernels_for_test(monkeypatch, fold_beta=False)
    plain_logits, plain_states, plain_calls = one_step(exact_view(model))
    assert plain_calls == [(start, 0, cfg.allow_neg_eigval)] * gdn
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(states, plain_states, strict=True))
