"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the decode step's recurrence as our kernel with its
programmatic-launch form (unimax.ops.decode_step.STEP_PDL) against fla's kernel, bit for bit,
between PDL GEMVs in a captured graph; and the fast steps decoding the same tokens with it on.
A file of its own so that bench/gpu_tests.sh runs it in a process of its own."""

import pytest
import torch

from helpers import gpu_model, require_fla
from helpers import gpu_prompt as prompt
from unimax import build_engine

pytestmark = pytest.mark.gpu


def require_pdl() -> None:
    require_fla()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")


@pytest.mark.parametrize("heads", [(16, 32), (16, 16)])  # (key, value) heads: 4B, 0.8B
def test_step_kernel_between_pdl_gemvs_on_gpu(heads, monkeypatch):
    """In-projection (a PDL GEMV writing q, k, v, b and a), the recurrence, out-projection (a
    PDL GEMV reading o), captured in a graph with STEP_PDL on, replayed on new inputs and a
    reset state: o, the state written in place and the out-projection equal the same chain
    run eagerly with fla's kernel, bit for bit (our kernel is fla's arithmetic at fla's
    launch; a read of q before the in-projection finished, or of o before the recurrence
    did, would show)."""
    import unimax.ops.decode_step as decode_step
    import unimax.ops.fused_gemv as fused_gemv

    require_pdl()
    num_k, num_v = heads
    dk = dv = 128
    conv_dim, value_dim, hidden = 2 * num_k * dk + num_v * dv, num_v * dv, 2560
    gen = torch.Generator(device="cuda").manual_seed(num_v)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)

    w_in = randn(conv_dim + 2 * num_v, hidden, scale=hidden ** -0.5)
    w_out = randn(hidden, value_dim, scale=value_dim ** -0.5)
    A_log = torch.randn(num_v, device="cuda", generator=gen)
    dt_bias = torch.randn(num_v, device="cuda", generator=gen)
    x = randn(1, hidden)
    state = torch.randn(1, num_v, dk, dv, device="cuda", generator=gen)

    def chain():
        y = fused_gemv.fused_gemv(x, w_in, None, conv_dim + 2 * num_v, hidden, "none")
        y3 = y.unsqueeze(1)
        mixed, b, a = y3.split([conv_dim, num_v, num_v], dim=-1)
        o = decode_step.fla_recurrent_step(mixed, a, b, state, A_log, dt_bias, num_k,
                                           beta_logits=True)
        out = fused_gemv.fused_gemv(o.reshape(1, value_dim), w_out, None, hidden, value_dim,
                                    "none")
        return o, out

    monkeypatch.setattr(fused_gemv, "PDL", True)
    monkeypatch.setattr(decode_step, "STEP_PDL", True)
    assert decode_step.step_pdl(x.device, False)  # (our kernel, launched programmatically)
    start = state.clone()
    chain()  # (warm-up: compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        x.copy_(randn(1, hidden))
        start.copy_(torch.randn(start.shape, device="cuda", generator=gen))
        state.copy_(start)
        graph.replay()
        ours = [t.clone() for t in (*got, state)]
        monkeypatch.setattr(decode_step, "STEP_PDL", False)  # fla's kernel, eagerly
        state.copy_(start)
        want = (*chain(), state)
        monkeypatch.setattr(decode_step, "STEP_PDL", True)
        for name, g, w in zip(("o", "out", "state"), ours, want, strict=True):
            assert torch.equal(g, w), (heads, name)


def test_fast_steps_decode_the_same_with_the_pdl_step_on_gpu(monkeypatch):
    """The compiled BF16 step and the full-FP8 draft step with PDL on for every launch decode
    the same tokens with STEP_PDL on as with it off (our kernel in place of fla's)."""
    import unimax.ops.decode_step as decode_step
    import unimax.ops.fused_gemv as fused_gemv

    require_pdl()
    model = gpu_model()
    x = prompt(60, seed=9)
    monkeypatch.setattr(fused_gemv, "PDL", True)
    for decode, draft in (("bf16", "tail"), ("fp8", "full")):
        tokens = []
        for on in (False, True):
            monkeypatch.setattr(decode_step, "STEP_PDL", on)
            engine = build_engine(model, decode=decode, draft=draft, block_size=8,
                                  compile_step=True)
            tokens.append(engine.generate_fast(x, 24))
        assert torch.equal(tokens[0], tokens[1]), decode
