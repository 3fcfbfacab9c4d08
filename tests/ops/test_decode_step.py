"""The GDN mixer's one-op decode step (unimax.ops.decode_step): fla's kernels against the twin in
Triton's interpreter (a child process, as tests/ops/test_gemv.py), the mixer's op path against its
torch forms, the op under inductor writing the cache's own buffers, and its input checks."""

import dataclasses

import pytest
import torch

from helpers import cache_states, randomize_, run_with_triton
from unimax import GDNForCausalLM
from unimax.ops.decode_step import gdn_decode_step, gdn_decode_step_ref
from unimax.tiny import TINY_CONFIG

CHILD = """
import torch
from unimax.ops.conv import causal_conv1d_step
from unimax.ops.decode_step import (_split_heads, decay, fla_conv_step, fla_recurrent_step,
                                    gdn_decode_step_ref)
from unimax.ops.gated_delta import recurrent_gated_delta_rule_ref
torch.manual_seed(0)
for batch, heads, value_heads, dk, dv, width, conv_dtype in [
        (1, 2, 4, 16, 16, 4, torch.float32), (1, 1, 1, 32, 8, 4, torch.bfloat16),
        (2, 2, 4, 16, 16, 4, torch.float32), (1, 2, 6, 16, 24, 3, torch.float32)]:
    conv_dim = 2 * heads * dk + value_heads * dv
    weight = torch.randn(conv_dim, width).to(torch.bfloat16)
    A_log, dt_bias = torch.randn(value_heads), torch.randn(value_heads)
    # a conv state holds past inputs: BF16 values, whatever its dtype
    conv = [torch.randn(batch, conv_dim, width).to(torch.bfloat16).to(conv_dtype)]
    rec = [torch.randn(batch, value_heads, dk, dv)]
    conv.append(conv[0].clone())
    rec.append(rec[0].clone())
    for step in range(3):
        # the in-projection's output: [mixed | z | b | a], mixed and a read as strided views
        proj = torch.randn(batch, 1, conv_dim + 3 * value_heads).to(torch.bfloat16)
        mixed, a = proj[..., :conv_dim], proj[..., -value_heads:]
        beta = proj[..., conv_dim:conv_dim + value_heads].sigmoid()
        # the convolution: the window exactly; the output within one BF16 rounding (the
        # interpreter truncates where the GPU rounds to nearest: tests/gpu/test_gpu_engine.py)
        y = fla_conv_step(mixed, conv[0], weight)
        y_ref, window = causal_conv1d_step(mixed, weight, conv[1])
        conv[1].copy_(window)
        assert torch.equal(conv[0], conv[1])
        ulp = 2 ** -7 * y_ref.float().abs()
        assert bool(((y.float() - y_ref.float()).abs() <= ulp).all())
        # the recurrence on the same y: the state in place, to fp32 summation order
        o = fla_recurrent_step(y, a, beta, rec[0], A_log, dt_bias, heads)
        q, k, v = _split_heads(y, heads, value_heads, dv)
        o_ref, state = recurrent_gated_delta_rule_ref(q, k, v, decay(a, A_log, dt_bias), beta,
                                                      rec[1])
        rec[1].copy_(state)
        rec_err = float((rec[0] - rec[1]).abs().max())
        o_err = float((o.float() - o_ref.float()).abs().max())
        assert o.shape == o_ref.shape == (batch, 1, value_heads, dv)
        assert rec_err < 1e-5 and o_err <= 2 ** -7 * float(o_ref.float().abs().max()), (
            rec_err, o_err)
    print("ok", batch, heads, value_heads, o_err, rec_err)
# several tokens in one launch, and other tiles than fla's (the launches bench/recurrent.py times)
from unimax.ops.decode_step import launch_recurrent
for tokens, block_v in ((3, 8), (9, 16), (1, 4)):
    q, k = torch.randn(2, 1, tokens, 2, 16).to(torch.bfloat16)
    v = torch.randn(1, tokens, 4, 32).to(torch.bfloat16)
    a, beta = torch.randn(1, tokens, 4), torch.rand(1, tokens, 4).to(torch.bfloat16)
    A_log, dt_bias, state = torch.randn(4), torch.randn(4), torch.randn(1, 4, 16, 32)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, decay(a, A_log, dt_bias), beta,
                                                  state)
    o = launch_recurrent(q, k, v, a, beta, state, A_log, dt_bias, block_v=block_v)
    assert float((state - s_ref).abs().max()) < 1e-5
    assert float((o.float() - o_ref.float()).abs().max()) <= 2 ** -7 * float(o_ref.abs().max())
    print("ok tokens", tokens, block_v)
# beta as logits, the sigmoid taken in the kernel (the draft's step: unimax.fused_draft)
q, k = torch.randn(2, 1, 1, 2, 16).to(torch.bfloat16)
v, a, b = torch.randn(1, 1, 4, 32).to(torch.bfloat16), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
A_log, dt_bias, state = torch.randn(4), torch.randn(4), torch.randn(1, 4, 16, 32)
o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, decay(a, A_log, dt_bias), b.sigmoid(),
                                              state)
o = launch_recurrent(q, k, v, a, b, state, A_log, dt_bias, beta_sigmoid=True)
assert float((state - s_ref).abs().max()) < 1e-5
assert float((o.float() - o_ref.float()).abs().max()) <= 2 ** -7 * float(o_ref.abs().max())
print("ok beta logits")
"""


def test_fla_decode_step_matches_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD, needs="fla")
    assert sum(line.startswith("ok") for line in out.splitlines()) == 8, out


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_mixer_op_step_equals_its_torch_forms(neg_eigval):
    """Decoding through the op (inference mode, default kernels) gives the logits and states of
    the mixer's torch forms (backend "torch": the op is not used), step after step."""
    config = dataclasses.replace(TINY_CONFIG, allow_neg_eigval=neg_eigval)
    model = GDNForCausalLM(config).to(torch.bfloat16)
    randomize_(model, seed=3)
    calls = []
    real = gdn_decode_step_ref

    def spy(*args):
        calls.append(1)
        return real(*args)

    tokens = torch.randint(0, config.vocab_size, (1, 12))
    runs = []
    for backend in ("auto", "torch"):
        for layer in model.layers:
            layer.mixer.backend = backend
        cache = model.make_recurrent_cache()
        with torch.inference_mode():
            logits = [model(tokens[:, :5], past_key_values=cache).logits[:, -1]]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("unimax.ops.decode_step.gdn_decode_step_ref", spy)
                logits += [model(tokens[:, i:i + 1], past_key_values=cache).logits[:, -1]
                           for i in range(5, 12)]
        runs.append((torch.cat(logits), [s.clone() for s in cache_states(cache)]))
    assert len(calls) == 7 * config.num_hidden_layers  # the op ran every step, then never
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_op_writes_the_cache_buffers_under_inductor():
    """Compiled (as the fast step is), the op still writes the states where the cache keeps
    them (views of one flat buffer, which captured graphs point at), reads of the state stay on
    their side of it, and the outputs are the eager op's. (Fails with the mutation undeclared
    or a wrong fake kernel.)"""
    torch.manual_seed(0)
    heads, value_heads, dk, dv, width = 2, 4, 8, 8, 4
    conv_dim = 2 * heads * dk + value_heads * dv
    weight, A_log, dt_bias = torch.randn(conv_dim, width), torch.randn(4), torch.randn(4)
    flat = [torch.randn(conv_dim * width + value_heads * dk * dv)]
    flat.append(flat[0].clone())

    def step(proj, buffer):
        conv_state = buffer[:conv_dim * width].view(1, conv_dim, width)
        rec = buffer[conv_dim * width:].view(1, value_heads, dk, dv)
        before = rec * 3  # read before the op: must see the state before it
        mixed, b, a = proj.split([conv_dim, value_heads, value_heads], dim=-1)
        o = gdn_decode_step(mixed, a, b.sigmoid(), conv_state, weight, rec, A_log, dt_bias,
                            heads)
        return o * 2, before, rec * 3  # and the state after it

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    # compiled here, not served from inductor's on-disk caches (which key on the graph, not on
    # the op's fake kernel or declared mutation: a change to either would go unseen)
    no_cache = (torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False))
    for _ in range(3):
        proj = torch.randn(1, 1, conv_dim + 2 * value_heads)
        with torch.inference_mode(), no_cache[0], no_cache[1]:
            got, want = compiled(proj, flat[0]), step(proj, flat[1])
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want, strict=True))
        assert torch.allclose(flat[0], flat[1], atol=1e-6)


def test_op_names_bad_inputs():
    torch.manual_seed(0)
    conv_dim = 2 * 2 * 8 + 4 * 8
    args = [torch.randn(1, 1, conv_dim), torch.randn(1, 1, 4), torch.rand(1, 1, 4),
            torch.randn(1, conv_dim, 4), torch.randn(conv_dim, 4), torch.randn(1, 4, 8, 8),
            torch.randn(4), torch.randn(4), 2]
    bad = {0: torch.randn(1, 2, conv_dim), 1: torch.randn(1, 1, 3),
           5: torch.randn(1, 4, 8, 8).to(torch.bfloat16), 8: 3}
    messages = {0: "one token per call", 1: "a and beta must be", 5: "must be fp32",
                8: "multiple of key heads"}
    for index, value in bad.items():
        call = list(args)
        call[index] = value
        with pytest.raises(ValueError, match=messages[index]):
            gdn_decode_step(*call)
