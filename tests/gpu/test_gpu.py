"""GPU (run on the lent H200 with fla installed: UNIMAX_ALLOW_FLA=1 pytest -m gpu): fla's kernels
against the torch references on the same weights, prefill and steps."""

import pytest
import torch

import unimax
from helpers import kernels_for_test, rel_err, require_fla, spied, write_qwen_checkpoint
from unimax import GDNConfig, GDNForCausalLM
from unimax.ops.gated_delta import gated_delta_rule

pytestmark = pytest.mark.gpu

CONFIG = GDNConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_k_heads=2,
                   num_v_heads=4, head_k_dim=64, head_v_dim=64, intermediate_size=512)


@pytest.mark.parametrize("seq_len", [65, 1000])
def test_fla_conv_matches_the_torch_forms(seq_len):
    """fla's causal conv (prompts on CUDA) against the torch long form and the step-exact block
    form, on a strided input (the layer hands it a slice of the merged projection) and a kept
    state."""
    from unimax.ops.conv import causal_conv1d, causal_conv1d_long, fla_conv

    if fla_conv() is None:
        pytest.fail("fla's causal conv is not importable")
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    merged = torch.randn(1, seq_len, 3 * 96, device="cuda", generator=gen).bfloat16()
    x = merged[..., 32:32 + 96]  # not contiguous
    weight = torch.randn(96, 4, device="cuda", generator=gen).bfloat16()
    state = torch.randn(1, 96, 4, device="cuda", generator=gen).bfloat16()
    y, new_state = causal_conv1d_long(x, weight, state, backend="fla")
    y_torch, state_torch = causal_conv1d_long(x, weight, state, backend="torch")
    y_block, state_block = causal_conv1d(x, weight, state)
    assert torch.equal(new_state, state_torch) and torch.equal(new_state, state_block)
    assert rel_err(y.float(), y_torch.float()) < 1e-2
    assert rel_err(y.float(), y_block.float()) < 1e-2


def test_fla_prompt_kernels_match_the_torch_forms(monkeypatch, tmp_path):
    """fla's fused RMSNorm (with Qwen3.5's 1 + w), gated RMSNorm (silu and sigmoid) and SwiGLU,
    which a prompt of more than LONG tokens takes with fla_prompt_kernels on, against the torch
    forms they replace (strided inputs, as the layers hand them); then a hybrid model's prefill
    logits with them on and off. Also checks they were called, and not for a 1-token step."""
    import unimax.norms as norms
    from unimax.norms import GatedRMSNorm, RMSNorm, swiglu

    if norms.fla_norm_ops() is None:
        pytest.fail("fla's norm kernels are not importable")
    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    x = randn(1, 300, 2 * 192).bfloat16()[..., 64:64 + 192]
    gate_up = randn(1, 300, 2 * 256).bfloat16()
    o, z = randn(1, 300, 4, 64).bfloat16(), randn(1, 300, 4, 64).bfloat16()
    norm = RMSNorm(192, 1e-6, offset=1.0).cuda()
    gated = {act: GatedRMSNorm(64, 1e-6, act).cuda() for act in ("silu", "sigmoid")}
    with torch.no_grad():
        norm.weight.normal_(0, 0.1, generator=gen)
        for g in gated.values():
            g.weight.normal_(1, 0.1, generator=gen)
    kernels_for_test(monkeypatch, fla_prompt_kernels=False)  # (on by default)
    off = [norm(x), *(g(o, z) for g in gated.values()), swiglu(*gate_up.split(256, -1))]
    kernels_for_test(monkeypatch, fla_prompt_kernels=True)
    calls = []
    real = norms.fla_norm_ops()
    names = ("rms_norm", "rms_norm_gated", "swiglu")
    monkeypatch.setattr(norms, "fla_norm_ops", lambda: tuple(
        spied(f, n, calls) for n, f in zip(names, real, strict=True)))
    on = [norm(x), *(g(o, z) for g in gated.values()), swiglu(*gate_up.split(256, -1))]
    assert calls == ["rms_norm", "rms_norm_gated", "rms_norm_gated", "swiglu"]
    for a, b in zip(on, off, strict=True):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-2
    norm(x[:, :1])  # a step keeps the torch form
    assert len(calls) == 4

    write_qwen_checkpoint(tmp_path, seed=6, num_layers=4,
                          layer_types=["linear_attention", "full_attention"] * 2)
    model = unimax.load_model(tmp_path, device="cuda", dtype="bfloat16", max_context=512)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), device="cuda", generator=gen)
    with_fla = model(ids).logits
    kernels_for_test(monkeypatch, fla_prompt_kernels=False)
    assert rel_err(with_fla, model(ids).logits) < 3e-2


@pytest.mark.parametrize("seq_len", [1, 40, 300])
def test_fla_ops_match_torch_reference(seq_len):
    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    b, h, hv, k, v = 1, 2, 4, 64, 128
    q = torch.randn(b, seq_len, h, k, device="cuda", generator=gen)
    kk = torch.randn(b, seq_len, h, k, device="cuda", generator=gen)
    vv = torch.randn(b, seq_len, hv, v, device="cuda", generator=gen)
    g = -torch.rand(b, seq_len, hv, device="cuda", generator=gen)
    beta = torch.rand(b, seq_len, hv, device="cuda", generator=gen)
    state = torch.randn(b, hv, k, v, device="cuda", generator=gen)
    o_ref, s_ref = gated_delta_rule(q, kk, vv, g, beta, state, backend="recurrent")
    o, s = gated_delta_rule(q, kk, vv, g, beta, state, backend="fla")
    # fla computes its dots in tf32 / bf16 on the tensor cores
    assert rel_err(o, o_ref) < 5e-3
    assert rel_err(s, s_ref) < 5e-3


@pytest.mark.parametrize("batch", [1, 2])
@torch.inference_mode()
def test_decode_step_op_matches_its_twin(batch):
    """The one-op decode step (fla's conv update and recurrent kernel, states in place) at a 4B
    layer's heads against its torch twin, step after step: the conv window exactly (on the GPU
    the conv output rounds to nearest, as the twin's), o and the state to fp32 summation."""
    from unimax.ops.decode_step import gdn_decode_step, gdn_decode_step_ref

    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(batch)
    heads, value_heads, dk, dv, width = 16, 32, 128, 128, 4
    conv_dim = 2 * heads * dk + value_heads * dv

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    weight = (randn(conv_dim, width) * 0.5).to(torch.bfloat16)
    A_log, dt_bias = randn(value_heads), randn(value_heads)
    conv = [randn(batch, conv_dim, width).to(torch.bfloat16)]
    rec = [randn(batch, value_heads, dk, dv) * 0.1]
    conv.append(conv[0].clone())
    rec.append(rec[0].clone())
    for _ in range(4):
        proj = randn(batch, 1, conv_dim + 3 * value_heads).to(torch.bfloat16)
        mixed, a = proj[..., :conv_dim], proj[..., -value_heads:]
        beta = proj[..., conv_dim:conv_dim + value_heads].sigmoid()
        o = gdn_decode_step(mixed, a, beta, conv[0], weight, rec[0], A_log, dt_bias, heads)
        o_ref = gdn_decode_step_ref(mixed, a, beta, conv[1], weight, rec[1], A_log, dt_bias,
                                    heads)
        assert torch.equal(conv[0], conv[1])
        assert rel_err(o, o_ref) < 1e-2 and rel_err(rec[0], rec[1]) < 1e-3
        # beta as logits, the sigmoid in the kernel (the draft's step): on copies of the states
        b = proj[..., conv_dim:conv_dim + value_heads]
        states = [t.clone() for t in (conv[0], rec[0], conv[0], rec[0])]
        o = gdn_decode_step(mixed, a, b, states[0], weight, states[1], A_log, dt_bias, heads,
                            True)
        o_ref = gdn_decode_step_ref(mixed, a, b, states[2], weight, states[3], A_log, dt_bias,
                                    heads, True)
        assert rel_err(o, o_ref) < 1e-2 and rel_err(states[1], states[3]) < 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
@torch.inference_mode()
def test_model_fla_path_matches_torch_path(dtype, tol):
    require_fla()
    model = GDNForCausalLM.random(CONFIG, device="cuda", dtype=dtype, seed=1)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 200), device="cuda")
    results = {}
    for backend in ("fla", "torch"):
        model.set_backend("auto" if backend == "fla" else "chunk")
        cache = model.make_recurrent_cache()
        logits = [model(input_ids=ids[:, :180], past_key_values=cache).logits]
        if backend == "torch":
            model.set_backend("recurrent")
        for t in range(180, 200):
            logits.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits)
        results[backend] = (torch.cat(logits, dim=1).float(),
                            torch.stack([s.recurrent_states[0] for s in cache.layers]))
    assert rel_err(results["fla"][0], results["torch"][0]) < tol
    assert rel_err(results["fla"][1], results["torch"][1]) < tol
