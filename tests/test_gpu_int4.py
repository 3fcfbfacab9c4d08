"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the int4 draft's GEMV (ops.int4_gemv; its PTX
dequantizer runs only here) against its twin at a 4B model's shapes and every tile they take,
and the int4 draft compiled in captured graphs: graphs == eager, verified == exact greedy up to
BF16 near-ties."""

import pytest
import torch

import unimax
from helpers import gpu_model
from helpers import gpu_prompt as prompt
from unimax import build_engine
from unimax.int4 import Int4Linear, pack_nibbles, quantize_int4
from unimax.ops import int4_gemv
from unimax.reference import first_divergence, is_near_tie

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n, k, group", [(12352, 2560, 128), (2560, 4096, 128),
                                         (2560, 9216, 128), (37, 1024, 128), (300, 384, 64)])
def test_int4_kernel_is_its_twin(n, k, group):
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=gen) / 50
    q, scale = quantize_int4(w, group)
    packed, scale16 = pack_nibbles(q), scale.half()
    for size in (1.0, 300.0):  # (x large: the FP16 sums of x / 64 stay finite)
        x = (torch.randn(1, k, device="cuda", generator=gen) * size).bfloat16()
        ready = int4_gemv.prepare_x(x)
        ref = int4_gemv.int4_matvec_ref(ready, packed, scale16, torch.float32)
        for tile in int4_gemv.tiles_for(k, group):
            y = int4_gemv.launch(ready, packed, scale16, torch.bfloat16, tile)
            assert rel(y, ref) < 4e-3, (tile, rel(y, ref))
        chosen = int4_gemv.int4_matvec(ready, packed, scale16, torch.bfloat16)
        assert rel(chosen, ref) < 4e-3
        flipped = int4_gemv.int4_matvec(ready, pack_nibbles(-q), scale16, torch.float32)
        assert rel(-flipped, ref) < 4e-3  # (the sign is read)
    assert (n, k, group) in int4_gemv.CHOICES  # (timed once, kept)


def test_int4_draft_engine_on_gpu():
    """The int4 draft compiled over the GEMV: graphs decode what it decodes eagerly; verified
    mode with it (its graphs captured as blocks need them) gives the one-token exact
    reference up to near-ties."""
    model = gpu_model()
    x = prompt(60, seed=6)
    graphs = build_engine(model, decode="fp8", draft="int4", block_size=8, compile_step=True)
    assert sum(isinstance(m, Int4Linear) for m in graphs.decode_model.modules()) == 16
    eager = build_engine(model, decode="fp8", draft="int4", block_size=8, compile_step=True,
                         use_graphs=False)
    assert torch.equal(graphs.generate_fast(x, 32), eager.generate_fast(x, 32))
    got, report = graphs.generate_verified(x, 64)
    reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
    divergence = first_divergence(model, x, got[0].tolist(), reference)
    assert is_near_tie(divergence), divergence
    assert report.drafted_tokens > 0
    print("int4 draft: acceptance", report.acceptance_rate, "rejected", report.rejected_blocks)
