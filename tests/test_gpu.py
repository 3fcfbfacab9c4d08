"""GPU (run on the lent H200 with fla installed: UNIMAX_ALLOW_FLA=1 pytest -m gpu): fla's kernels
against the torch references on the same weights, prefill and steps."""

import pytest
import torch

import unimax
from helpers import rel_err, write_qwen_checkpoint
from unimax import GDNConfig, GDNForCausalLM
from unimax.ops.gated_delta import fla_ops, gated_delta_rule

pytestmark = pytest.mark.gpu

CONFIG = GDNConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_k_heads=2,
                   num_v_heads=4, head_k_dim=64, head_v_dim=64, intermediate_size=512)


def require_fla():
    if fla_ops() is None:
        pytest.fail("flash-linear-attention is not importable: install it and run with "
                    "UNIMAX_ALLOW_FLA=1")


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


@torch.inference_mode()
def test_checkpoint_on_cuda_matches_cpu(tmp_path):
    require_fla()
    write_qwen_checkpoint(tmp_path, seed=3)
    cpu = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    gpu = unimax.load_model(tmp_path, device="cuda", dtype="float32")
    ids = torch.randint(0, 97, (1, 150))
    expected = cpu(input_ids=ids).logits
    got = gpu(input_ids=ids.cuda()).logits.cpu()
    assert rel_err(got, expected) < 5e-3
    greedy_cpu = unimax.exact_greedy_tokens(cpu, ids, 16)
    greedy_gpu = unimax.exact_greedy_tokens(gpu, ids.cuda(), 16).cpu()
    assert torch.equal(greedy_cpu, greedy_gpu)
