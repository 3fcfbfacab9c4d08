"""GPU (run on the lent H200 with fla installed: UNIMAX_ALLOW_FLA=1 pytest -m gpu): the verify
block's in-projection with the tape in its epilogue (unimax.ops.in_proj_tape) at a 4B layer's
shape against the plain GEMM and the tape's kernel, bit for bit; and the compiled verifier with
it on (the kernel configuration's tape_epilogue) decoding exact greedy. A file of its own so that
tests/gpu.sh runs it in a process of its own."""

import pytest
import torch

from helpers import assert_verified_exact_on_gpu, gpu_model, kernels_for_test, require_fla

pytestmark = pytest.mark.gpu


@torch.inference_mode()
def test_in_proj_tape_on_gpu():
    """The verify block's in-projection with the tape in its epilogue (unimax.ops.in_proj_tape)
    at a 4B layer's shape, 9 and 17 tokens, two tiles: its product and tape bit for bit what
    the plain tensor-core GEMM at that tile and then the tape's kernel write; then the op
    through its timed choice writes what its chosen form writes."""
    from unimax.ops import block_mixer, in_proj_tape
    from unimax.ops.gemv import gemv

    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(12)
    heads, value_heads, dk, dv, width, hidden = 16, 32, 128, 128, 4, 2560
    conv_dim, value_dim = 2 * heads * dk + value_heads * dv, value_heads * dv
    n = conv_dim + value_dim + 2 * value_heads
    weight = (0.02 * torch.randn(n, hidden, device="cuda", generator=gen)).bfloat16()
    args = ((torch.randn(1, conv_dim, width, device="cuda", generator=gen)).bfloat16(),
            (0.5 * torch.randn(conv_dim, width, device="cuda", generator=gen)).bfloat16(),
            torch.randn(value_heads, device="cuda", generator=gen),
            torch.randn(value_heads, device="cuda", generator=gen))
    for tokens in (9, 17):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
        shape = (tokens + 1, conv_dim, heads, value_heads, dk, dv)
        for tile in ((32, 256, 4, 3), (64, 128, 4, 4)):
            want_y = gemv(x, weight, kernel="dot@" + "x".join(map(str, tile)))
            want = middle_layer_tape(*shape)
            mixed, b, a = in_proj_tape.split(want_y, conv_dim, value_dim)
            block_mixer.launch(mixed, a, b, *args, want, False, block_mixer.TILES[1])
            got = middle_layer_tape(*shape)
            y = in_proj_tape.launch(x, weight, *args, got, conv_dim, value_dim, False, tile)
            assert torch.equal(y, want_y), (tokens, tile)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), (tokens, tile, i)
                assert g[:, :tokens].any() and not g[:, tokens:].any(), (tokens, tile, i)
        known = set(in_proj_tape.CHOICES)
        got = middle_layer_tape(*shape)
        y = in_proj_tape.in_proj_tape(x, weight, *args, *got, conv_dim, value_dim, False)
        (key,) = set(in_proj_tape.CHOICES) - known
        again = middle_layer_tape(*shape)
        y2 = in_proj_tape.run(in_proj_tape.CHOICES[key], x, weight, *args, again, conv_dim,
                              value_dim, False)
        assert torch.equal(y, y2)
        assert all(torch.equal(g, w) for g, w in zip(got, again, strict=True))
        print(tokens, "chose", in_proj_tape.CHOICES[key])


def middle_layer_tape(tokens, conv_dim, heads, value_heads, dk, dv) -> tuple:
    """A three-layer tape's middle layer's buffers (views, as the cache's LayerTape holds)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    full = (torch.zeros(3, tokens, conv_dim, **bf16), torch.zeros(3, tokens, heads, dk, **bf16),
            torch.zeros(3, tokens, heads, dk, **bf16),
            torch.zeros(3, tokens, value_heads, dv, **bf16),
            torch.zeros(3, tokens, value_heads, device="cuda"),
            torch.zeros(3, tokens, value_heads, **bf16))
    return tuple(x[1:2] for x in full)


def test_verifier_with_the_tape_epilogue_is_exact_on_gpu(monkeypatch):
    """The compiled verifier with tape_epilogue on (the default; set here so that the test
    keeps checking it): its blocks' in-projections go through the op (its timed choice made per
    block length), and verified replies (full and tail drafts) are exact greedy up to BF16
    near-ties against the one-token eager reference."""
    from unimax.ops import in_proj_tape

    require_fla()
    kernels_for_test(monkeypatch, tape_epilogue=True)
    known = set(in_proj_tape.CHOICES)
    assert_verified_exact_on_gpu(gpu_model(), seed=23)
    chosen = {key: in_proj_tape.CHOICES[key] for key in set(in_proj_tape.CHOICES) - known}
    assert chosen, "no verify block went through the op"
    print("choices", chosen)
