"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): verified decoding in captured graphs (greedy and
sampled, fixed and adaptive draft lengths, the compiled verifier), the rewind, a hybrid model's
graphs. A file apart from tests/test_gpu_engine.py so that bench/gpu_tests.sh runs the two side
by side, each in a process of its own, within one device call."""

import pytest
import torch

import unimax
from helpers import GPU_CONFIG, gpu_model, rel_err, verifier_launches
from helpers import gpu_prompt as prompt
from unimax import GDNForCausalLM, SamplingParams, build_engine

pytestmark = pytest.mark.gpu

CONFIG = GPU_CONFIG


@pytest.fixture(scope="module")
def model():
    return gpu_model()


def test_hybrid_graphs_on_gpu(tmp_path):
    """Hybrid model (gated attention over static KV buffers) on the GPU: graph decoding equals
    eager decoding; verified decoding with captured verifier/replay rolls KV back correctly;
    every graph captured up front (as the app does) with a short-prefill bucket as long as the
    KV buffers (512), then a prompt in it that leaves the context's last tokens to the reply."""
    from helpers import write_qwen_checkpoint
    from unimax.reference import first_divergence, is_near_tie

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    write_qwen_checkpoint(tmp_path, seed=4, num_layers=4, layer_types=layer_types)
    model = unimax.load_model(tmp_path, device="cuda", dtype="bfloat16", max_context=512)
    x = torch.randint(0, 97, (1, 120), device="cuda")
    graphs = build_engine(model, decode="bf16", block_size=8)
    eager = build_engine(model, decode="bf16", block_size=8, use_graphs=False)
    assert torch.equal(graphs.generate_fast(x, 40), eager.generate_fast(x, 40))
    for draft in ("tail", "full"):
        g = build_engine(model, decode="fp8", draft=draft, block_size=8)
        e = build_engine(model, decode="fp8", draft=draft, block_size=8, use_graphs=False)
        assert torch.equal(g.generate_verified(x, 40)[0], e.generate_verified(x, 40)[0])
    g.capture_graphs(verified=True)  # (each warm-up from position 0: the 512 bucket fits)
    long = torch.randint(0, 97, (1, 500), device="cuda")
    got = g.generate_verified(long, 12)[0][0].tolist()  # (its prompt in the padded 512 graph)
    reference = unimax.exact_greedy_tokens(model, long, 12)[0].tolist()
    assert is_near_tie(first_divergence(model, long, got, reference))


@pytest.mark.parametrize("draft", ["tail", "full"])
def test_verified_sampling_on_gpu(model, draft):
    """Speculative sampling in captured graphs (the draft's recorded distributions, the
    sampled verifier, the rewind): the eager engine's tokens for the same seed, a seed
    reproduces, and the drafts are both kept and refused. (Its distribution is tested on the
    CPU, tests/test_speculative.py.)"""
    x = prompt(60, seed=5)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    graphs = build_engine(model, decode="fp8", draft=draft, block_size=8)
    graphs.capture_graphs(verified=True, sampled=True)
    eager = build_engine(model, decode="fp8", draft=draft, block_size=8, use_graphs=False)
    # A fixed draft length: which tokens a seed draws depends on the block lengths, and the
    # adaptive policy chooses them from the graphs' replay times (the eager engine has none)
    run = dict(mode="verified", sampling=params, draft_block=8)
    got = graphs.generate(x, 48, **run)
    assert got.tokens == eager.generate(x, 48, **run).tokens
    assert got.tokens == graphs.generate(x, 48, **run).tokens
    assert 0 < got.verify.accepted_draft_tokens < got.verify.drafted_tokens
    print(draft, "sampled acceptance", got.verify.acceptance_rate)
    # The adaptive policy with the graphs' costs given to both engines (the same block cuts):
    # padded short blocks and sampled exact runs in graphs draw the eager engine's tokens
    policy = graphs.draft_length
    eager.draft_length.calibrate(policy.draft_ms, policy.verify_ms, policy.rewind_ms)
    adaptive = dict(mode="verified", sampling=params)
    assert graphs.generate(x, 48, **adaptive).tokens == eager.generate(x, 48, **adaptive).tokens


def test_compiled_verifier_is_exact(model):
    """Verified mode with the fast step: compiled draft step, the verifier's full block compiled
    through the small-M linears, rejections rewound from the tape with fla's kernel: exact
    greedy decoding up to BF16 near-ties, against the one-token eager reference."""
    from unimax.reference import first_divergence, is_near_tie

    for draft in ("full", "tail"):
        x = prompt(80, seed=12)
        engine = build_engine(model, decode="fp8", draft=draft, block_size=8, compile_step=True)
        assert engine.verifier.compiled is not None
        got, report = engine.generate_verified(x, 64)
        reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), (draft, divergence)
        print(draft, "acceptance", report.acceptance_rate, "rejected", report.rejected_blocks)


@torch.inference_mode()
def test_rewind_on_gpu_equals_a_forward_over_the_prefix():
    """The tape rewind with fla's recurrent kernel (the GPU path) against a plain prefill."""
    fp32 = GDNForCausalLM.random(CONFIG, device="cuda", dtype=torch.float32, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt_ids = torch.randint(0, CONFIG.vocab_size, (1, 40), device="cuda", generator=gen)
    block = torch.randint(0, CONFIG.vocab_size, (1, 8), device="cuda", generator=gen)
    cache = fp32.make_recurrent_cache()
    fp32(input_ids=prompt_ids, past_key_values=cache, use_cache=True)
    before = cache.empty_like()
    unimax.copy_cache_(before, cache)
    tape = fp32.make_tape(8)
    with cache.recording(tape):
        fp32.forward_unchecked(block, cache)
    for length in (1, 4, 8):
        fp32.rewind_unchecked(cache, before, tape, length)
        expected = fp32.make_recurrent_cache()
        fp32(input_ids=torch.cat([prompt_ids, block[:, :length]], dim=1),
             past_key_values=expected, use_cache=True)
        assert rel_err(cache.recurrent_buffer, expected.recurrent_buffer) < 5e-3
        assert rel_err(cache.conv_buffer, expected.conv_buffer) < 1e-6
        assert int(cache.position) == 40 + length


def test_adaptive_verified_in_captured_graphs_is_exact(model, monkeypatch):
    """The app's verified mode: every graph captured up front, the draft-length policy
    calibrated from their replay times, compiled forwards: padded short blocks and exact runs
    (the full draft on random weights is poor, so the policy falls back to them) in graphs give
    the eager one-token reference's tokens up to BF16 near-ties."""
    from unimax.reference import first_divergence, is_near_tie

    x = prompt(80, seed=13)
    engine = build_engine(model, decode="fp8", draft="full", block_size=8, compile_step=True)
    engine.capture_graphs()
    assert engine.draft_length.calibrated
    launched = verifier_launches(engine, monkeypatch)
    got, report = engine.generate_verified(x, 96)
    reference = unimax.exact_greedy_tokens(model, x, 96)[0].tolist()
    divergence = first_divergence(model, x, got[0].tolist(), reference)
    assert is_near_tie(divergence), divergence
    kinds = sorted({(key[0], key[1]) for key in launched})
    print("acceptance", report.acceptance_rate, "blocks", kinds, "verify ms",
          {k: round(ms, 3) for k, ms in engine.draft_length.verify_ms.items()})
    assert set(launched) <= set(engine.verifier.runner.graphs)  # nothing captured late


def test_rows_attention_tensor_cores_on_gpu():
    """The verifier block's attention on the tensor cores (torch.bmm with fp32 output) against
    its fp32 form and fp32 SDPA, at Qwen3.5-0.8B's heads, over a slice of a longer KV buffer."""
    from unimax.attention import rows_attention

    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 8, 9, 256, device="cuda", generator=gen).bfloat16()
    buffer = torch.randn(2, 1, 2, 4096, 256, device="cuda", generator=gen).bfloat16()
    k, v = buffer[:, :, :, :1500]
    positions = 1480 + torch.arange(9, device="cuda")
    mask = torch.arange(1500, device="cuda")[None, :] <= positions[:, None]
    got = rows_attention(q, k, v, mask, 256 ** -0.5)  # the default on CUDA: tensor cores
    fp32_form = rows_attention(q, k, v, mask, 256 ** -0.5, tensor_cores=False)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=256 ** -0.5, enable_gqa=True)
    assert rel_err(got, want) < 1e-2  # (BF16 output: ~3e-3)
    assert rel_err(got, fp32_form) < 1e-2
