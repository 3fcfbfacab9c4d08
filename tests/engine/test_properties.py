"""Randomized equivalence (hypothesis): on any small shape and input, the fast paths compute what
the plain definitions compute."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimax
from helpers import rel_err
from unimax import GDNConfig, GDNForCausalLM
from unimax.ops.gated_delta import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

FAST = settings(max_examples=15, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(seq_len=st.integers(1, 150), k_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       head_k=st.sampled_from([4, 8, 16]), head_v=st.sampled_from([4, 8]),
       chunk=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_chunked_rule_equals_token_loop(seq_len, k_heads, group, head_k, head_v, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    v_heads = k_heads * group
    q = torch.randn(1, seq_len, k_heads, head_k, generator=gen)
    k = torch.randn(1, seq_len, k_heads, head_k, generator=gen)
    v = torch.randn(1, seq_len, v_heads, head_v, generator=gen)
    g = -3 * torch.rand(1, seq_len, v_heads, generator=gen)
    beta = torch.rand(1, seq_len, v_heads, generator=gen)
    state = torch.randn(1, v_heads, head_k, head_v, generator=gen)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk_size=chunk)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


@FAST
@given(layers=st.integers(1, 3), k_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       prompt=st.integers(1, 40), n=st.integers(1, 20), block=st.integers(1, 6),
       draft=st.sampled_from(["tail", "full"]), seed=st.integers(0, 2**16))
def test_verified_equals_exact_on_random_models(layers, k_heads, group, prompt, n, block, draft,
                                                seed):
    config = GDNConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers,
                       num_k_heads=k_heads, num_v_heads=k_heads * group, head_k_dim=16,
                       head_v_dim=8, intermediate_size=48)
    model = GDNForCausalLM(config).eval()
    model.init_random_weights(seed=seed, std=0.15)
    x = torch.randint(0, 64, (1, prompt), generator=torch.Generator().manual_seed(seed))
    expected = unimax.exact_greedy_tokens(model, x, n)
    engine = unimax.build_engine(model, decode="fp8", draft=draft, block_size=block)
    got, report = engine.generate_verified(x, n)
    assert torch.equal(got, expected)
    assert report.generated_tokens == n
    if n > 1:
        # every block emits its accepted drafts and one exact token
        assert report.generated_tokens == 1 + report.accepted_draft_tokens + \
            report.verifier_blocks
        assert report.rejected_blocks <= report.verifier_blocks
