"""GPU (run on the lent H200 with fla installed: UNIMAX_ALLOW_FLA=1 pytest -m gpu): the verify
block's own kernels at a 4B layer's heads: the few-token recurrence (unimax.ops.short_recurrence)
against fla's fused recurrent kernel, and the recording mixer as one kernel
(unimax.ops.block_mixer) against its twin. A file of its own: Triton compiles every launch
setting, and bench/gpu_tests.sh runs each file in parallel."""

import pytest
import torch

from helpers import rel_err
from unimax.ops.gated_delta import fla_ops

pytestmark = pytest.mark.gpu


def require_fla():
    if fla_ops() is None:
        pytest.fail("flash-linear-attention is not importable: install it and run with "
                    "UNIMAX_ALLOW_FLA=1")


@torch.inference_mode()
def test_short_recurrence_matches_fla_on_gpu():
    """Our few-token kernel (unimax.ops.short_recurrence) at a 4B layer's heads, every launch
    setting, against fla's fused recurrent kernel: the verifier's block (1 x 9 and 17 tokens,
    one layer) and its rewind (32 layers as the batch, strided views of the tape), o to BF16
    rounding and the state to fp32 summation; then the op: its timed choice is kept, it
    returns what the chosen kernel does, and in a captured graph replays what it computes
    eagerly."""
    from unimax.ops import short_recurrence as short

    require_fla()
    _, fused_recurrent = fla_ops()
    gen = torch.Generator(device="cuda").manual_seed(7)
    heads, value_heads, dk, dv = 16, 32, 128, 128
    for batch, tokens in ((1, 2), (1, 9), (1, 17), (32, 9)):
        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q, k = (randn(batch, tokens + 8, heads, dk).bfloat16()[:, :tokens] for _ in range(2))
        v = randn(batch, tokens + 8, value_heads, dv).bfloat16()[:, :tokens]
        g = -torch.rand(batch, tokens, value_heads, device="cuda", generator=gen)
        beta = torch.rand(batch, tokens, value_heads, device="cuda", generator=gen).bfloat16()
        h0 = randn(batch, value_heads, dk, dv)
        ref_o, ref_state = fused_recurrent(q=q.contiguous(), k=k.contiguous(),
                                           v=v.contiguous(), g=g, beta=beta, initial_state=h0,
                                           output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        for tile in short.TILES:
            o, state = short.launch_short(q, k, v, g, beta, h0, True, *tile)
            assert rel_err(o.float(), ref_o.float()) < 2e-3, (batch, tokens, tile)
            assert rel_err(state, ref_state) < 1e-5, (batch, tokens, tile)
        o, state = short.short_gated_delta_rule(q, k, v, g, beta, h0, True)
        key = next(key for key in short.CHOICES if key[:2] == (batch, tokens))
        chosen_o, chosen_state = short.run(short.CHOICES[key], q, k, v, g, beta, h0, True)
        assert torch.equal(o, chosen_o) and torch.equal(state, chosen_state)
        print(batch, tokens, "chose", short.CHOICES[key])
        short.short_gated_delta_rule(q, k, v, g, beta, h0, False)  # (its choice: not in a
        graph = torch.cuda.CUDAGraph()                                # capture)
        with torch.cuda.graph(graph):
            graph_o, _ = short.short_gated_delta_rule(q, k, v, g, beta, h0, False)
        q.copy_(randn(*q.shape).bfloat16())
        graph.replay()
        assert torch.equal(graph_o, short.short_gated_delta_rule(q, k, v, g, beta, h0,
                                                                 False)[0])


@torch.inference_mode()
def test_block_mixer_matches_its_twin_on_gpu():
    """The verifier's recording mixer as one kernel (unimax.ops.block_mixer) at a 4B layer's
    heads, 9 and 17 tokens, every tile, against its twin (the mixer's torch forms) on the GPU:
    the tape's raw conv input bit for bit, q, k, v, g and beta to rounding, o to BF16
    rounding; then the op through its timed choice returns what the chosen tile does."""
    from unimax.ops import block_mixer

    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(9)
    heads, value_heads, dk, dv, width = 16, 32, 128, 128, 4
    conv_dim = 2 * heads * dk + value_heads * dv
    for tokens in (9, 17):
        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        proj = randn(1, tokens, conv_dim + value_heads * dv + 2 * value_heads).bfloat16()
        mixed = proj[..., :conv_dim]
        b = proj[..., conv_dim + value_heads * dv:][..., :value_heads]
        a = proj[..., conv_dim + value_heads * dv + value_heads:]
        args = (mixed, a, b, randn(1, conv_dim, width).bfloat16(),
                (0.5 * randn(conv_dim, width)).bfloat16(), randn(value_heads),
                randn(value_heads), randn(1, value_heads, dk, dv) * 0.1)

        def tape(tokens=tokens):
            t, bf16 = tokens + 1, dict(device="cuda", dtype=torch.bfloat16)
            return (torch.zeros(1, t, conv_dim, **bf16), torch.zeros(1, t, heads, dk, **bf16),
                    torch.zeros(1, t, heads, dk, **bf16),
                    torch.zeros(1, t, value_heads, dv, **bf16),
                    torch.zeros(1, t, value_heads, device="cuda"),
                    torch.zeros(1, t, value_heads, **bf16))

        ref_tape = tape()
        ref = block_mixer.gdn_block_record_ref(*args, ref_tape, heads, False)
        for tile in block_mixer.TILES:
            got_tape = tape()
            o = block_mixer.launch(*args, got_tape, heads, False, tile)
            assert rel_err(o.float(), ref.float()) < 5e-3, (tokens, tile)
            assert torch.equal(got_tape[0], ref_tape[0]), (tokens, tile)
            for name, x, y in zip("qkvgb", got_tape[1:], ref_tape[1:], strict=True):
                assert rel_err(x.float(), y.float()) < 2e-3, (tokens, tile, name)
        got_tape = tape()
        o = block_mixer.gdn_block_record(*args, *got_tape, heads, False)
        key = next(key for key in block_mixer.CHOICES if key[0] == tokens)
        again = block_mixer.launch(*args, tape(), heads, False,
                                   block_mixer._tile(block_mixer.CHOICES[key]))
        assert torch.equal(o, again)
        print(tokens, "chose", block_mixer.CHOICES[key])
