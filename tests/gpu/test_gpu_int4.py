"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the int4 draft's GEMV (ops.int4_gemv; its PTX
dequantizer runs only here) against its twin at a 4B model's shapes and every tile they take,
and the int4 draft compiled in captured graphs: graphs == eager, verified == exact greedy up to
BF16 near-ties."""

import copy

import pytest
import torch

import unimax
from helpers import gpu_model, kernels_for_test
from helpers import gpu_prompt as prompt
from unimax import build_engine
from unimax.fast_step import gemv_view
from unimax.fp8 import quantize_view
from unimax.int4 import Int4Linear, pack_nibbles, quantize_int4
from unimax.ops import int4_gemv, pdl
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


def test_int4_fused_kernel_is_its_twin(monkeypatch):
    """The fused int4 GEMV (ops.int4_fused) at a 4B draft's four linears, with their prologues
    and epilogues (the in-projection's convolution and beta, the residuals), at every tile
    they take, against the twin; the conv window rolled. Launched with programmatic dependent
    launch (signalled at the start or the end; two tiles a linear), the same values bit for
    bit."""
    from unimax.int4 import quantize_packed
    from unimax.ops.int4_fused import int4_fused, int4_fused_ref

    gen = torch.Generator(device="cuda").manual_seed(7)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    hidden, value, mlp = 2560, 4096, 9216
    cases = [  # (N, K, prologue, x, z, norm weight, residual?, conv?)
        (12352, hidden, "rms", randn(1, hidden, scale=3), None, 1 + randn(hidden, scale=0.1),
         False, True),
        (hidden, value, "gated_silu", randn(1, value), randn(1, value), 1 + randn(128,
                                                                              scale=0.1),
         True, False),
        (2 * mlp, hidden, "rms", randn(1, hidden, scale=3), None, 1 + randn(hidden, scale=0.1),
         False, False),
        (hidden, mlp, "swiglu", randn(1, 2 * mlp), None, None, True, False)]
    for n, k, prologue, x, z, norm, res, conv in cases:
        packed, scale = quantize_packed(torch.randn(n, k, device="cuda", generator=gen) / 50,
                                        128)
        residual = randn(1, n) if res else None
        conv_w, state, beta = (randn(8192, 4), randn(1, 8192, 4), (12320, 32, False)) \
            if conv else (None, None, None)
        want_state = None if state is None else state.clone()
        ref = int4_fused_ref(x, packed, scale, prologue, norm, z, residual, 1e-6, 0.0,
                             want_state, conv_w, beta)
        for tile in int4_gemv.tiles_for(k, 128):
            got_state = None if state is None else state.clone()
            y = int4_fused(x, packed, scale, prologue, norm, z, residual, 1e-6, 0.0, got_state,
                           conv_w, beta, tile=tile)
            assert rel(y, ref) < 1e-2, (n, k, prologue, tile, rel(y, ref))
            if conv:
                assert torch.equal(got_state[..., :3], state[..., 1:])
                assert rel(got_state[..., 3], want_state[..., 3]) < 1e-2
            if tile in int4_gemv.tiles_for(k, 128)[:2]:  # (PDL: each a compile of its own)
                for trigger in pdl.PDL_TRIGGERS:
                    kernels_for_test(monkeypatch, pdl=True)
                    kernels_for_test(monkeypatch, pdl_trigger=trigger)
                    pdl_state = None if state is None else state.clone()
                    got = int4_fused(x, packed, scale, prologue, norm, z, residual, 1e-6, 0.0,
                                     pdl_state, conv_w, beta, tile=tile)
                    monkeypatch.undo()
                    assert torch.equal(got, y), (n, k, prologue, tile, trigger)
                    assert state is None or torch.equal(pdl_state, got_state)


def test_int4_draft_engine_on_gpu(monkeypatch):
    """The int4 draft compiled, unfused (kernels.active().fuse_int4 off) and fused (ops.int4_fused,
    the default): graphs decode what they decode eagerly; the fused view's one-token steps
    the unfused view's logits up to rounding; verified mode with either (its graphs captured as
    blocks need them) gives the one-token exact reference up to near-ties."""
    model = gpu_model()
    x = prompt(60, seed=6)
    kernels_for_test(monkeypatch, fuse_int4=False)
    graphs = build_engine(model, decode="fp8", draft="int4", block_size=8, compile_step=True)
    assert sum(isinstance(m, Int4Linear) for m in graphs.decode_model.modules()) == 16
    eager = build_engine(model, decode="fp8", draft="int4", block_size=8, compile_step=True,
                         use_graphs=False)
    assert not any(getattr(block, "fused", False) for block in graphs.decode_model.layers)
    assert torch.equal(graphs.generate_fast(x, 32), eager.generate_fast(x, 32))
    # The fused int4 view against the unfused one, one-token steps. In fp32 the two compute
    # the same logits up to sum order; in BF16 they round in different places and drift apart
    # on this random model (the FP8 fused draft's ~2% on average, single steps more:
    # tests/gpu/test_gpu_fused.py; an earlier run saw a 2.7% step), so the
    # BF16 bound is on the mean, as there.
    kernels_for_test(monkeypatch, fuse_int4=True)
    drafts = [quantize_view(m, "int4") for m in (model, copy.deepcopy(model).float())]
    views = [gemv_view(d, fuse=f) for d in drafts for f in (True, False)]
    assert all(block.fused for block in views[0].layers)
    assert not any(getattr(block, "fused", False) for block in views[1].layers)
    caches = [view.make_recurrent_cache() for view in views]
    errors = {"bf16": [], "fp32": []}
    with torch.inference_mode():
        for i in range(20):
            a, b, a32, b32 = (view(input_ids=x[:, i: i + 1], past_key_values=cache,
                                   use_cache=True).logits
                              for view, cache in zip(views, caches, strict=True))
            errors["bf16"].append(rel(a, b))
            errors["fp32"].append(rel(a32, b32))
    print("int4 fused vs unfused view, rel err", {k: (sum(v) / len(v), max(v))
                                                  for k, v in errors.items()})
    assert max(errors["fp32"]) < 1e-2, errors
    assert sum(errors["bf16"]) / len(errors["bf16"]) < 5e-2, errors
    got, report = graphs.generate_verified(x, 64)
    reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
    divergence = first_divergence(model, x, got[0].tolist(), reference)
    assert is_near_tie(divergence), divergence
    assert report.drafted_tokens > 0
    print("int4 draft: acceptance", report.acceptance_rate, "rejected", report.rejected_blocks)
    # the fused form compiled and captured (fuse_int4 on, the default, set above): graphs ==
    # eager, and verified with it the exact reference up to near-ties
    fused = {g: build_engine(model, decode="fp8", draft="int4", block_size=8, compile_step=True,
                             use_graphs=g) for g in (True, False)}
    assert all(block.fused for block in fused[True].decode_model.layers)
    assert torch.equal(fused[True].generate_fast(x, 32), fused[False].generate_fast(x, 32))
    got, report = fused[True].generate_verified(x, 64)
    divergence = first_divergence(model, x, got[0].tolist(), reference)
    assert is_near_tie(divergence), divergence
    print("fused int4 draft: acceptance", report.acceptance_rate)
