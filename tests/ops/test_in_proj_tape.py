"""The verify block's in-projection with the tape in its GEMM's epilogue (unimax.ops.in_proj_tape):
its Triton kernel in Triton's interpreter bit for bit against the plain tensor-core GEMM at the
same tile followed by the tape's kernel; PTX for the H200 and the L4; the verifier's view,
with the op forced on the CPU (where it runs its twin), records what the plain mixer records,
compiled without a graph break; schema and bad input."""

import pytest
import torch

from helpers import run_with_triton, spied, verifier_recordings
from unimax.ops import block_mixer, in_proj_tape

CHILD = r"""
import torch
from unimax.ops import block_mixer, in_proj_tape
from unimax.ops.gemv import gemv

torch.manual_seed(0)
h, dk, hv, dv, width, hidden = 2, 16, 4, 16, 4, 48
conv_dim, value_dim = 2 * h * dk + hv * dv, hv * dv  # 128 conv channels, z 64, b 4, a 4
n = conv_dim + value_dim + 2 * hv
for tokens in (5, 9, 17):
    for neg in (False, True):
        x = torch.randn(tokens, hidden).bfloat16()
        weight = (0.3 * torch.randn(n, hidden)).bfloat16()
        conv_state = torch.randn(1, conv_dim, width).bfloat16()
        conv_weight = (0.5 * torch.randn(conv_dim, width)).bfloat16()
        A_log, dt_bias = torch.randn(hv), torch.randn(hv)

        def tape():  # a middle layer's views of a three-layer tape, two rows to spare
            t, bf16 = tokens + 2, torch.bfloat16
            full = (torch.zeros(3, t, conv_dim, dtype=bf16), torch.zeros(3, t, h, dk, dtype=bf16),
                    torch.zeros(3, t, h, dk, dtype=bf16), torch.zeros(3, t, hv, dv, dtype=bf16),
                    torch.zeros(3, t, hv), torch.zeros(3, t, hv, dtype=bf16))
            return tuple(x[1:2] for x in full)

        args = (conv_state, conv_weight, A_log, dt_bias)
        # tiles whose columns straddle q | k | v | z | b | a differently (16, 32 and 64 wide)
        for tile in ((16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4)):
            name = "dot@" + "x".join(map(str, tile))
            want_y = gemv(x, weight, kernel=name)  # the plain GEMM at this tile
            want = tape()
            mixed, b, a = in_proj_tape.split(want_y, conv_dim, value_dim)
            block_mixer.launch(mixed, a, b, *args, want, neg, block_mixer.TILES[0])
            got = tape()
            y = in_proj_tape.launch(x, weight, *args, got, conv_dim, value_dim, neg, tile)
            assert torch.equal(y, want_y), (tokens, tile)
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), (tokens, neg, tile, i)
                assert g[:, :tokens].any() and not g[:, tokens:].any(), (tokens, tile, i)
        print("ok", tokens, neg)
"""


def test_kernel_equals_the_gemm_and_the_tape_kernel_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("ok") == 6, out


COMPILE_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimax.ops.gemv import DOT_TILES
from unimax.ops.in_proj_tape_kernel import in_proj_tape_kernel

i32, bf16, f32 = "i32", "*bf16", "*fp32"
sig = dict(x_ptr=bf16, w_ptr=bf16, y_ptr=bf16, M=i32, N=i32, K=i32, stride_xm=i32,
           stride_wn=i32, stride_ym=i32, conv_state=bf16, conv_weight=bf16, A_log=f32,
           dt_bias=f32, tape_x=bf16, tape_q=bf16, tape_k=bf16, tape_v=bf16, tape_g=f32,
           tape_beta=bf16, stride_xt=i32, stride_qt=i32, stride_vt=i32, stride_gt=i32)
for arch in (90, 89):  # H100/H200, L4
    for n, k, warps, stages in DOT_TILES[:3]:
        consts = dict(KD=2048, CD=8192, B0=12288, HV=32, W=4, NEG_EIGVAL=False, BLOCK_M=16,
                      BLOCK_N=n, BLOCK_K=k, DOT_F32=False)
        src = ASTSource(fn=in_proj_tape_kernel, signature={**sig, **dict.fromkeys(consts,
                        "constexpr")}, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        ptx = compiled.asm["ptx"]
        # tensor cores (wgmma on Hopper, mma on Ada), the epilogue's barrier and the gates' exp
        print(arch, n, "mma" in ptx, "bar.sync" in ptx, "ex2.approx" in ptx,
              len(compiled.asm["cubin"]) > 0)
"""


def test_kernel_compiles_for_hopper_and_ada():
    """The kernel compiles to PTX and a cubin for the H200 (sm_90) and the L4 (sm_89) at a 4B
    layer's in-projection without a GPU, with tensor-core products and the epilogue's barrier."""
    out = run_with_triton(COMPILE_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 6 and all(row[2:] == ["True"] * 4 for row in rows), out


@pytest.fixture
def forced(monkeypatch):
    """The op and the recording path forced on the CPU (where both run their twins), the
    op's and the tape op's calls spied."""
    calls = []
    monkeypatch.setattr(block_mixer, "usable", lambda x: True)
    monkeypatch.setattr(in_proj_tape, "wanted", lambda x: True)
    monkeypatch.setattr(in_proj_tape, "in_proj_tape",
                        spied(in_proj_tape.in_proj_tape, "in_proj_tape", calls))
    monkeypatch.setattr("unimax.layers.gdn_block_record",
                        spied(block_mixer.gdn_block_record, "tape op", calls))
    return calls


@torch.inference_mode()
def test_view_records_through_the_op_what_the_plain_mixer_records(pure_or_hybrid, forced,
                                                                   monkeypatch):
    """The verifier's view (fast_step.gemv_view's GemvRecordingMixer) records a block through
    the op, once per GDN layer and never through the tape's op, and leaves the logits, tape
    and states that the model's own recording forward leaves, bit for bit."""
    from unimax.fast_step import gemv_view

    model = pure_or_hybrid
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7), generator=gen)
    block = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)

    def record(forward):
        cache = model.make_recurrent_cache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tape = model.make_tape(10)
        with cache.recording(tape):
            logits = forward(block, cache)
        return logits, tape, cache

    logits, tape, cache = record(gemv_view(model, fuse=False).forward_unchecked)
    gdn_layers = sum(layer is not None for layer in tape.layers)
    assert forced == ["in_proj_tape"] * gdn_layers and gdn_layers > 0
    forced.clear()
    ref_logits, ref_tape, ref_cache = record(model.forward_unchecked)
    assert forced == ["tape op"] * gdn_layers
    assert torch.equal(logits, ref_logits)
    for got, want in zip(tape.tensors(), ref_tape.tensors(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(cache.recurrent_buffer, ref_cache.recurrent_buffer)
    assert torch.equal(cache.conv_buffer, ref_cache.conv_buffer)


def test_verifier_view_compiles_in_one_graph_through_the_op(forced):
    """The verifier's compiled view (inductor's CPU backend, fullgraph) with the op forced: no
    graph break, the op's tape mutations written in place, the compiled recording forward's
    logits and tape the eager one's (inductor's norms round their own way)."""
    out = verifier_recordings()
    assert "in_proj_tape" in forced and "tape op" not in forced
    for got, expected in zip(*out, strict=True):
        assert float((got - expected).float().norm() / expected.float().norm()) < 1e-5


def _op_args(tokens=5, rows_extra=0):
    h, hv, dk, dv, hidden = 2, 4, 8, 8, 24
    conv_dim, value_dim = 2 * h * dk + hv * dv, hv * dv
    n = conv_dim + value_dim + 2 * hv + rows_extra
    tape = (torch.zeros(1, 6, conv_dim), torch.zeros(1, 6, h, dk), torch.zeros(1, 6, h, dk),
            torch.zeros(1, 6, hv, dv), torch.zeros(1, 6, hv), torch.zeros(1, 6, hv))
    return (torch.randn(tokens, hidden), torch.randn(n, hidden), torch.randn(1, conv_dim, 4),
            torch.randn(conv_dim, 4), torch.randn(hv), torch.randn(hv), *tape, conv_dim,
            value_dim, False)


def test_op_passes_opcheck():
    """Schema (the tape's buffers declared mutated, the product returned), fake kernel and
    compiled dispatch: torch.library.opcheck."""
    torch.library.opcheck(in_proj_tape.in_proj_tape, _op_args())


def test_op_names_bad_input():
    with pytest.raises(ValueError, match="rows must be conv_dim"):
        in_proj_tape.in_proj_tape(*_op_args(rows_extra=1))
    with pytest.raises(ValueError, match="in_proj_tape: the tape .* 7\\+ tokens"):  # (of 6)
        in_proj_tape.in_proj_tape(*_op_args(tokens=7))
    for name in ("dot@1x2x3", "dotsplit@32x256x4x3x4", "dot"):  # (a bad tile, form, no tile)
        with pytest.raises(ValueError, match="one of"):
            in_proj_tape.run(name, *_op_args()[:6], _op_args()[6:12], 64, 32, False)


def test_candidates_are_apart_the_plain_gemms_tile_and_the_default(monkeypatch):
    """The per-shape choice times "apart", the kernel at the plain GEMM's own tile for the shape
    (where ops.gemv took "dot" at a tile) and at the default "dot" tile: nameable forms all."""
    from unimax.ops import gemv

    x, weight = torch.zeros(9, 24), torch.zeros(80, 24)
    key = (9, 80, 24, weight.dtype)
    for plain, want in (("dot@32x256x4x3", ("apart", "dot@32x256x4x3", "dot@64x256x4x3")),
                        ("dot@64x256x4x3", ("apart", "dot@64x256x4x3")),
                        ("cublas", ("apart", "dot@64x256x4x3")),
                        ("dotsplit@32x256x4x3x4", ("apart", "dot@64x256x4x3"))):
        monkeypatch.setitem(gemv.CHOICES, key, plain)
        got = in_proj_tape.candidates(x, weight)
        assert got == want, plain
        assert set(got) <= set(in_proj_tape.names())
