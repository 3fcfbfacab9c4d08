"""GPU (run on the lent H200 with fla installed: UNIMAX_ALLOW_FLA=1 pytest -m gpu): the verify
block's own kernels at a 4B layer's heads: the few-token recurrence (unimax.ops.short_recurrence)
against fla's fused recurrent kernel, and bit for bit across block cuts; the one-pass rewind
against the plain one; the recording mixer's
tape as one kernel (unimax.ops.block_mixer) against its twin; the split-K tensor-core kernel
for its narrow linears (unimax.ops.gemv's "dotsplit"); its gate-up GEMM with SwiGLU in the
epilogue (unimax.ops.gemv_swiglu); the one-token in-projection with beta in its epilogue
(unimax.ops.in_proj_conv). A file of its own: Triton
compiles every launch setting, and tests/gpu.sh runs each file in parallel."""

import itertools

import pytest
import torch

from helpers import assert_replays_match_eager, rel_err, require_fla
from unimax.ops.gated_delta import fla_ops

pytestmark = pytest.mark.gpu


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
        key = (heads, dk, value_heads, dv, torch.bfloat16, False)  # (one choice for all)
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
def test_short_recurrence_states_do_not_depend_on_block_cuts_on_gpu():
    """The verified stream must not depend on where its blocks were cut: a 9-token verify block
    from state S (the op, no final state) and, for every cut n, the rewind of n tokens (the op
    over 32 layers of a tape, span 9 with the steps past n masked, as
    GDNForCausalLM.rewind_unchecked runs it in a graph) followed by a block from the rewound
    state give the same outputs bit for bit (an H200 run: with the verify
    block's recurrence in a kernel of its own, 22 of 45 blocks of a forced acceptance of 1.0
    were rejected)."""
    from unimax.ops.gated_delta import first_steps_only
    from unimax.ops.short_recurrence import short_gated_delta_rule

    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(11)
    layers, heads, value_heads, dk, dv, span, layer = 32, 16, 32, 128, 128, 9, 5

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = (randn(layers, 18, heads, dk).bfloat16() for _ in range(2))  # (a tape: 18 rows)
    v = randn(layers, 18, value_heads, dv).bfloat16()
    g = -torch.rand(layers, 18, value_heads, device="cuda", generator=gen)
    beta = torch.rand(layers, 18, value_heads, device="cuda", generator=gen).bfloat16()
    h0 = randn(layers, value_heads, dk, dv)

    def block(start, state):  # layer's block of `span` tokens from `start`, from its state
        rows = slice(start, start + span)
        return short_gated_delta_rule(*(x[layer:layer + 1, rows] for x in (q, k, v, g, beta)),
                                      state, False)[0]

    whole = block(0, h0[layer:layer + 1])
    for n in range(1, span):
        gm, bm = first_steps_only(g[:, :span], beta[:, :span], torch.tensor(n, device="cuda"))
        _, rewound = short_gated_delta_rule(q[:, :span], k[:, :span], v[:, :span], gm, bm, h0,
                                            True)
        after = block(n, rewound[layer:layer + 1].contiguous())
        assert torch.equal(after[:, :span - n], whole[:, n:]), n


@torch.inference_mode()
def test_one_pass_rewind_matches_the_plain_rewind_on_gpu(monkeypatch):
    """The verifier's one-pass rewind (ops.short_recurrence.rewind_states_) at a 4B model's
    heads (32 layers as the batch, a 9-step span of the tape with the steps past n masked, as
    GDNForCausalLM.rewind_unchecked runs it): the state it started from kept, and the state
    after it written in place and to the draft's copy, bit for bit what the plain op gives (the
    snapshot's state in, a new state out), at two of our launch settings, eagerly and replayed
    in a CUDA graph; where fla's kernel is the heads' choice it does nothing and says so."""
    from unimax.ops import short_recurrence as short
    from unimax.ops.gated_delta import first_steps_only

    require_fla()
    gen = torch.Generator(device="cuda").manual_seed(12)
    heads = (16, 128, 32, 128)  # 32 layers, a tape's views (18 rows, 9 used)
    q, k, v, g, beta, h0 = short.random_run(32, 9, heads, torch.bfloat16, gen, rows=18)
    key = (*heads, torch.bfloat16, False)
    length = torch.zeros((), dtype=torch.long, device="cuda")
    for name in (short.DEFAULT, "short@4x1x8"):
        monkeypatch.setitem(short.CHOICES, key, name)
        state, saved, copy = h0.clone(), torch.zeros_like(h0), torch.zeros_like(h0)

        def rewind(state=state, saved=saved, copy=copy):
            gm, bm = first_steps_only(g, beta, length)
            return short.rewind_states_(q, k, v, gm, bm, state, saved, copy)

        for n in (1, 4, 9):
            length.fill_(n)
            gm, bm = first_steps_only(g, beta, length)
            _, want = short.short_gated_delta_rule(q, k, v, gm, bm, h0, True)
            state.copy_(h0)
            saved.zero_()
            copy.zero_()
            assert rewind()
            assert torch.equal(saved, h0), (name, n)
            assert torch.equal(state, want) and torch.equal(copy, want), (name, n)
        graph = torch.cuda.CUDAGraph()
        state.copy_(h0)
        with torch.cuda.graph(graph):
            rewind()
        for n in (2, 7):
            length.fill_(n)
            state.copy_(h0)
            saved.zero_()
            copy.zero_()
            graph.replay()
            gm, bm = first_steps_only(g, beta, length)
            _, want = short.short_gated_delta_rule(q, k, v, gm, bm, h0, True)
            assert torch.equal(saved, h0) and torch.equal(state, want), (name, n)
            assert torch.equal(copy, want), (name, n)
    monkeypatch.setitem(short.CHOICES, key, "fla")
    state = h0.clone()
    assert not short.rewind_states_(q, k, v, g, beta, state, torch.zeros_like(h0),
                                    torch.zeros_like(h0))
    assert torch.equal(state, h0)


@torch.inference_mode()
def test_the_verifiers_choice_on_gpu(monkeypatch):
    """choose_for_blocks at a 4B model's heads (32 layers, 9-token blocks): one of the op's
    candidates, timed at a whole block's cost and kept, which the op then runs for every call
    with those heads (blocks, rewinds, short prompts) and which a second call returns as is."""
    from unimax.ops import short_recurrence as short

    require_fla()
    monkeypatch.setattr(short, "CHOICES", {})
    name = short.choose_for_blocks(16, 128, 32, 128, torch.bfloat16, 32, 9,
                                   torch.device("cuda"))
    assert name in short.names()
    key = (16, 128, 32, 128, torch.bfloat16, False)
    assert short.CHOICES == {key: name}
    q = torch.randn(1, 9, 16, 128, device="cuda").bfloat16()
    v = torch.randn(1, 9, 32, 128, device="cuda").bfloat16()
    g = -torch.rand(1, 9, 32, device="cuda")
    assert short.choose(q, q, v, g, g.bfloat16(), torch.zeros(1, 32, 128, 128, device="cuda"),
                        False) == name
    assert short.choose_for_blocks(16, 128, 32, 128, torch.bfloat16, 32, 9,
                                   torch.device("cuda")) == name
    print("verifier's choice", name)


@torch.inference_mode()
def test_block_mixer_matches_its_twin_on_gpu():
    """The verifier's recording mixer's tape as one kernel (unimax.ops.block_mixer) at a 4B
    layer's heads, 9 and 17 tokens, every tile, against its twin (the mixer's torch forms) on
    the GPU: the raw conv input bit for bit, q, k, v, g and beta to rounding; then the op
    through its timed choice writes what the chosen tile writes."""
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
                randn(value_heads))

        def tape(tokens=tokens):
            t, bf16 = tokens + 1, dict(device="cuda", dtype=torch.bfloat16)
            return (torch.zeros(1, t, conv_dim, **bf16), torch.zeros(1, t, heads, dk, **bf16),
                    torch.zeros(1, t, heads, dk, **bf16),
                    torch.zeros(1, t, value_heads, dv, **bf16),
                    torch.zeros(1, t, value_heads, device="cuda"),
                    torch.zeros(1, t, value_heads, **bf16))

        ref_tape = tape()
        block_mixer.gdn_block_record_ref(*args, ref_tape, False)
        for tile in block_mixer.TILES:
            got_tape = tape()
            block_mixer.launch(*args, got_tape, False, tile)
            assert torch.equal(got_tape[0], ref_tape[0]), (tokens, tile)
            for name, x, y in zip("qkvgb", got_tape[1:], ref_tape[1:], strict=True):
                assert rel_err(x.float(), y.float()) < 2e-3, (tokens, tile, name)
                assert not x[:, tokens:].any(), (tokens, tile, name)
        got_tape = tape()
        known = set(block_mixer.CHOICES)
        block_mixer.gdn_block_record(*args, *got_tape, False)
        (key,) = set(block_mixer.CHOICES) - known  # (this length's choice, made by that call)
        again = tape()
        block_mixer.launch(*args, again, False, block_mixer._tile(block_mixer.CHOICES[key]))
        assert all(torch.equal(x, y) for x, y in zip(got_tape, again, strict=True))
        print(tokens, "chose", block_mixer.CHOICES[key])


@torch.inference_mode()
def test_dotsplit_on_gpu():
    """The verify block's split-K tensor-core kernel ("dotsplit", unimax.ops.gemv) at a 4B
    model's narrow, K-long linears (out- and down-projection) and 9 and 17 rows (16- and
    32-row tiles), BF16 and FP8 weights, every tile: the twin's outputs; in a captured graph,
    replays with new inputs give what eager calls give (each launch sets its counters back);
    the per-shape choice, offered it, still computes the twin's outputs."""
    from unimax.fp8 import quantize_rows
    from unimax.ops import gemv as ops

    gen = torch.Generator(device="cuda").manual_seed(11)
    for (n, k), m in itertools.product(((2560, 4096), (2560, 9216)), (9, 17)):
        w = torch.randn(n, k, device="cuda", generator=gen) / 50
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        for weight, scale in (quantize_rows(w), (w.to(torch.bfloat16), None)):
            ref = ops.gemv_ref(x, weight, scale)
            for tile in ops.DOTSPLIT_TILES:
                got = ops.gemv(x, weight, scale, kernel=f"dotsplit@{ops.tile_text(tile)}")
                assert rel_err(got.float(), ref.float()) < 1e-2, (n, k, tile, weight.dtype)
            ops.CHOICES.clear()
            got = ops.small_m_linear(x, weight, scale)
            assert rel_err(got.float(), ref.float()) < 1e-2, (n, k, "chosen", weight.dtype)
            print(n, k, m, weight.dtype, "chose", list(ops.CHOICES.values()))
    weight = w.to(torch.bfloat16)
    assert_replays_match_eager(
        lambda: ops.gemv(x, weight, None, kernel="dotsplit@32x256x4x3x8"), x, gen, "dotsplit")


@torch.inference_mode()
def test_gemv_swiglu_on_gpu():
    """The verify block's gate-up GEMM with SwiGLU in its epilogue (unimax.ops.gemv_swiglu) at
    a 4B and a 0.8B model's MLP and 9 and 17 rows, BF16 and FP8 weights, every tile that fits the
    GPU, and cuBLAS + the activation kernel: the twin's outputs, where the GPU rounds to
    nearest (the interpreter test's twin truncates): elements off only where the products'
    fp32 sums land on the other side of a BF16 rounding; the timed choice too; in a captured
    graph, replays give what eager calls give; a view's GemvSwiGLUMLP gives the plain MLP's
    output."""
    from unimax.fast_step import GemvSwiGLUMLP
    from unimax.fp8 import quantize_rows
    from unimax.layers import SwiGLUMLP
    from unimax.ops import gemv as ops
    from unimax.ops import gemv_swiglu as sw

    gen = torch.Generator(device="cuda").manual_seed(12)
    for (n, k), m in itertools.product(((9216, 2560), (3584, 1024)), (9, 17)):
        w = torch.randn(2 * n, k, device="cuda", generator=gen) / 30
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        for weight, scale in ((w.to(torch.bfloat16), None), quantize_rows(w)):
            ref = sw.swiglu_ref(x, weight, scale)
            names = [f"dot@{ops.tile_text(tile)}" for tile in ops.DOT_TILES]
            names += ["cublas"] if scale is None else []
            ran = []
            for name in names:
                try:
                    got = sw.gemv_swiglu(x, weight, scale, name)
                except ops._unfit_errors():
                    continue  # (two W tiles a stage: the widest tiles pass shared memory)
                ran.append(name)
                off = float((got != ref).float().mean())
                assert rel_err(got.float(), ref.float()) < 1e-2, (n, name, weight.dtype)
                assert off < 0.02, (n, name, weight.dtype, off)
            assert len(ran) >= (5 if m <= 16 else 3), ran
            sw.CHOICES.clear()
            got = sw.small_m_swiglu(x, weight, scale)
            assert rel_err(got.float(), ref.float()) < 1e-2, (n, "chosen", weight.dtype)
            print(n, k, m, weight.dtype, "ran", len(ran), "chose", list(sw.CHOICES.values()))
    weight = w.to(torch.bfloat16)
    for name in ("dot@32x256x4x3", "cublas"):
        assert_replays_match_eager(lambda name=name: sw.gemv_swiglu(x, weight, None, name), x,
                                   gen, name)
    mlp = SwiGLUMLP(k, n).to("cuda", torch.bfloat16)
    fused = GemvSwiGLUMLP(mlp)
    h = torch.randn(1, 9, k, device="cuda", generator=gen).to(torch.bfloat16)
    assert rel_err(fused(h).float(), mlp(h).float()) < 1e-2


@torch.inference_mode()
def test_beta_epilogue_on_gpu():
    """The verifier's one-token in-projection with beta in its epilogue (ops.in_proj_conv's
    beta_heads) at a 4B layer (12352 x 2560, BF16 as the verifier's view; FP8 too), the
    forms the timed choice offers and the op itself: every other output and the rolled
    windows as without beta, bit for bit, and the b channels the mixer's write_strength
    (torch's sigmoid, rounded to nearest) of the kernel's own b: ours takes 1 / (1 + exp(-b))
    as the block's tape kernel does, so an element may be one BF16 step off where torch's
    exponential lands on the other side of a rounding (allowed: 2% of them, 1 step)."""
    from unimax.fp8 import quantize_rows
    from unimax.ops import fused_gemv as fg
    from unimax.ops.decode_step import write_strength
    from unimax.ops.in_proj_conv import fused_in_proj_conv

    gen = torch.Generator(device="cuda").manual_seed(13)
    conv, start, heads, n, k = 8192, 8192 + 4096, 32, 12352, 2560
    w = torch.randn(n, k, device="cuda", generator=gen) / 50
    norm = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    conv_w = torch.randn(conv, 4, device="cuda", generator=gen).to(torch.bfloat16)
    state = torch.randn(1, conv, 4, device="cuda", generator=gen).to(torch.bfloat16)
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[start:start + heads] = False
    off = total = 0
    for weight, scale in ((w.to(torch.bfloat16), None), quantize_rows(w)):
        names = ["rows@16x256x4", "rows@64x128x4", "tma@32x256x4x4"] + (
            ["rows16@16x256x4", "tma16@32x256x4x4"] if scale is not None else [])
        for double in (False, True):
            for name in names + ["op"]:
                x = 4 * torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
                plain_state, beta_state = state.clone(), state.clone()
                if name == "op":
                    fg.CHOICES.clear()
                    plain = fused_in_proj_conv(x, weight, scale, n, k, norm, 1e-6, 1.0,
                                               plain_state, conv_w)
                    got = fused_in_proj_conv(x, weight, scale, n, k, norm, 1e-6, 1.0,
                                             beta_state, conv_w, start, heads, double)
                else:
                    kw = dict(eps=1e-6, offset=1.0, kernel=name, conv_weight=conv_w)
                    plain = fg.fused_gemv(x, weight, scale, n, k, "rms", norm,
                                          conv_state=plain_state, **kw)
                    got = fg.fused_gemv(x, weight, scale, n, k, "rms", norm,
                                        conv_state=beta_state, beta=(start, heads, double),
                                        **kw)
                what = (name, weight.dtype, double)
                assert torch.equal(got[:, keep], plain[:, keep]), what
                assert torch.equal(beta_state, plain_state), what
                want = write_strength(plain[:, start:start + heads], double)
                beta = got[:, start:start + heads]
                steps = (beta.view(torch.int16).int() - want.view(torch.int16).int()).abs()
                assert int(steps.max()) <= 1, (what, beta, want)
                off, total = off + int((steps > 0).sum()), total + steps.numel()
    print("beta elements off by one step:", off, "of", total)
    assert off <= 0.02 * total, (off, total)
