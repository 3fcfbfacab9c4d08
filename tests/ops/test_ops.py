"""The gated delta rule and causal conv references against each other and against
transformers' own torch implementation of the same rule."""

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from unimax.ops.conv import (
    causal_conv1d,
    causal_conv1d_long,
    causal_conv1d_step,
    conv_window_after,
)
from unimax.ops.gated_delta import (
    chunk_gated_delta_rule_ref,
    gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)


def random_inputs(seq_len, k_heads=2, v_heads=4, batch=2, head_k=16, head_v=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, k_heads, head_k, generator=gen)
    k = torch.randn(batch, seq_len, k_heads, head_k, generator=gen)
    v = torch.randn(batch, seq_len, v_heads, head_v, generator=gen)
    g = -2.0 * torch.rand(batch, seq_len, v_heads, generator=gen)
    beta = torch.rand(batch, seq_len, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, head_k, head_v, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [1, 5, 64, 131])
@pytest.mark.parametrize("v_heads", [2, 4])
def test_chunk_equals_recurrent(seq_len, v_heads):
    q, k, v, g, beta, state = random_inputs(seq_len, v_heads=v_heads)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, state)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


def test_matches_transformers_torch_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = random_inputs(37)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                    output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    for backend in ("chunk", "recurrent"):
        o, s = gated_delta_rule(q, k, v, g, beta, state, backend=backend)
        assert rel_err(o, o_ref) < 1e-5, backend
        assert rel_err(s, s_ref) < 1e-5, backend


def test_split_sequence_carries_state():
    q, k, v, g, beta, _ = random_inputs(90)
    o_full, s_full = chunk_gated_delta_rule_ref(q, k, v, g, beta)
    o1, s1 = chunk_gated_delta_rule_ref(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50])
    o2, s2 = chunk_gated_delta_rule_ref(q[:, 50:], k[:, 50:], v[:, 50:], g[:, 50:],
                                        beta[:, 50:], s1)
    assert rel_err(torch.cat([o1, o2], dim=1), o_full) < 1e-5
    assert rel_err(s2, s_full) < 1e-5


def test_unknown_backend_is_named():
    q, k, v, g, beta, state = random_inputs(3)
    with pytest.raises(ValueError, match="unknown gated delta rule backend 'cuda'"):
        gated_delta_rule(q, k, v, g, beta, state, backend="cuda")


def test_fla_lookup_reads_as_a_constant_when_compiled():
    """fla_ops, once looked up (the engines do before they compile), is a constant to
    torch.compile: a compiled caller neither imports inside its trace (here, where fla is
    hidden, that import fails and breaks the graph: fullgraph raises) nor warns about a cache
    wrapper (functools.cache did both)."""
    import warnings

    from unimax.ops.gated_delta import fla_ops

    answer = fla_ops()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + (1.0 if fla_ops() is None else 2.0), fullgraph=True,
                             backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = compiled(torch.zeros(2))
    assert out.tolist() == [1.0 if answer is None else 2.0] * 2


def test_conv_matches_padded_conv_and_steps():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    zero = torch.zeros(2, 6, 4)
    y, state = causal_conv1d(x, weight, zero)
    expected = F.silu(F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=3,
                               groups=6)[..., :11]).transpose(1, 2)
    assert rel_err(y, expected) < 1e-6
    y_head, s = causal_conv1d(x[:, :7], weight, zero)
    steps = [y_head]
    for t in range(7, 11):
        y_t, s = causal_conv1d_step(x[:, t:t + 1], weight, s)
        steps.append(y_t)
    assert rel_err(torch.cat(steps, dim=1), expected) < 1e-6
    assert torch.equal(s, state)


@pytest.mark.parametrize("length", [65, 300])
@pytest.mark.parametrize("fresh", [True, False])
def test_long_conv_matches_the_block_form(length, fresh):
    """The prompt form (a depthwise fp32 conv1d here; fla's kernel on CUDA, tests/gpu/test_gpu.py)
    against the block form the steps agree with: same outputs to rounding, same state."""
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, 6, generator=gen).to(torch.bfloat16)
    weight = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
    state = (torch.zeros(2, 6, 4) if fresh else torch.randn(2, 6, 4, generator=gen)
             ).to(torch.bfloat16)
    y, new_state = causal_conv1d_long(x, weight, state, backend="torch")
    y_ref, state_ref = causal_conv1d(x, weight, state)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y.float(), y_ref.float()) < 1e-2  # BF16 outputs of fp32 sums
    assert torch.equal(new_state, state_ref)
    with pytest.raises(ValueError, match="unknown conv backend 'cuda'"):
        causal_conv1d_long(x, weight, state, backend="cuda")


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_conv_window_after_a_device_length(tokens):
    """The window after the first ``valid`` of the inputs (valid a device scalar, 0 .. all of
    them, fewer inputs than the window too) is the conv state the block form leaves after
    exactly those inputs."""
    gen = torch.Generator().manual_seed(tokens)
    state, weight = torch.randn(2, 6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    inputs = torch.randn(2, tokens, 6, generator=gen)
    for valid in range(tokens + 1):
        _, expected = causal_conv1d(inputs[:, :valid], weight, state) if valid else (None, state)
        assert torch.equal(conv_window_after(state, inputs, torch.tensor(valid)), expected)


def test_mixer_takes_the_long_conv_for_prompts(monkeypatch):
    """A GDN layer sends a prompt of more than LONG tokens through the long form, a block of
    at most LONG through the step-exact one."""
    import unimax.layers as layers
    from unimax import GDNForCausalLM
    from unimax.tiny import TINY_CONFIG

    used = []
    for name in ("causal_conv1d", "causal_conv1d_long"):
        real = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, real=real, name=name, **k:
                            used.append(name) or real(*a, **k))
    model = GDNForCausalLM(TINY_CONFIG).eval()
    model.init_random_weights(seed=0)
    for length in (layers.LONG, layers.LONG + 1):
        used.clear()
        model(input_ids=torch.zeros(1, length, dtype=torch.long),
              past_key_values=model.make_recurrent_cache())
        assert set(used) == {"causal_conv1d" if length <= layers.LONG else "causal_conv1d_long"}
