"""The verifier's recording mixer's tape as one op (unimax.ops.block_mixer): its Triton kernel
in Triton's interpreter against the twin (the mixer's torch forms); the model's recording
forward through the op (forced on the CPU, where it runs the twin) writes the tape and logits
the torch forms write, and verified decoding through it stays exact; the verify block's and the
rewind's recurrence compile to one register layout (bit-equal states across block cuts)."""

import pytest
import torch

import unimax
from helpers import run_with_triton, spied, verifier_recordings
from unimax.ops import block_mixer
from unimax.ops import short_recurrence as short

CHILD = r"""
import torch
from unimax.ops.block_mixer import TILES, gdn_block_record_ref, launch

def rel(a, b):
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))

torch.manual_seed(0)
h, hv, dk, dv, width = 2, 4, 16, 8, 4
conv_dim = 2 * h * dk + hv * dv  # 96: 64-channel tiles split q/k from v across programs
for tokens in (2, 9, 33):
    for dtype in (torch.float32, torch.bfloat16):
        for neg in (False, True):
            # the in-projection's output: [mixed | z | b | a], mixed etc. are views of it
            proj = torch.randn(1, tokens, conv_dim + hv * dv + 2 * hv).to(dtype)
            mixed = proj[..., :conv_dim]
            b = proj[..., conv_dim + hv * dv: conv_dim + hv * dv + hv]
            a = proj[..., conv_dim + hv * dv + hv:]
            conv_state = torch.randn(1, conv_dim, width).to(dtype)
            conv_weight = (0.5 * torch.randn(conv_dim, width)).to(dtype)
            A_log, dt_bias = torch.randn(hv), torch.randn(hv)

            def tape():
                t = tokens + 2
                return (torch.zeros(1, t, conv_dim, dtype=dtype),
                        torch.zeros(1, t, h, dk, dtype=dtype),
                        torch.zeros(1, t, h, dk, dtype=dtype),
                        torch.zeros(1, t, hv, dv, dtype=dtype),
                        torch.zeros(1, t, hv, dtype=torch.float32),
                        torch.zeros(1, t, hv, dtype=dtype))

            args = (mixed, a, b, conv_state, conv_weight, A_log, dt_bias)
            ref_tape = tape()
            gdn_block_record_ref(*args, ref_tape, neg)
            for tile in TILES:
                got_tape = tape()
                launch(*args, got_tape, neg, tile)
                assert torch.equal(got_tape[0], ref_tape[0])  # the raw conv input: a copy
                for name, x, y in zip("qkvgb", got_tape[1:], ref_tape[1:]):
                    # the conv (its 4 products summed in another order) and the gates agree
                    # to rounding; the rows past the block untouched
                    assert rel(x, y) < (1e-6 if dtype == torch.float32 else 1e-2), (name, tile)
                    assert x[:, :tokens].abs().sum() > 0, name
                    assert not x[:, tokens:].any(), name
            print("ok", tokens, dtype, neg)
"""


def test_tape_kernel_matches_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("ok") == 12, out


@torch.inference_mode()
def test_recording_forward_through_the_op_writes_what_the_torch_forms_write(pure_or_hybrid,
                                                                          monkeypatch):
    """Forced on the CPU (where the op runs its twin), the verifier's recording forward goes
    through the op (spied) and leaves the tape, the logits and the untouched states the torch
    forms leave, bit for bit."""
    model = pure_or_hybrid
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7), generator=gen)
    block = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)

    def record(forced: bool):
        cache = model.make_recurrent_cache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tape = model.make_tape(6)
        with monkeypatch.context() as m:
            m.setattr(block_mixer, "usable", lambda mixed: forced)
            calls = []
            m.setattr("unimax.layers.gdn_block_record",
                      spied(block_mixer.gdn_block_record, "op", calls))
            with cache.recording(tape):
                logits = model.forward_unchecked(block, cache)
        return logits, tape, cache, calls

    logits, tape, cache, calls = record(True)
    ref_logits, ref_tape, ref_cache, ref_calls = record(False)
    gdn_layers = sum(layer is not None for layer in tape.layers)
    assert len(calls) == gdn_layers > 0 and not ref_calls
    assert torch.equal(logits, ref_logits)
    for got, want in zip(tape.tensors(), ref_tape.tensors(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(cache.recurrent_buffer, ref_cache.recurrent_buffer)
    assert torch.equal(cache.conv_buffer, ref_cache.conv_buffer)


def test_verified_through_the_op_equals_exact_greedy(pure_or_hybrid, monkeypatch):
    """Verified decoding with every verify block through the op (forced; the twin on the CPU)
    emits the exact model's greedy tokens, with rejections (a full-FP8 draft of random
    weights)."""
    from unimax.fp8 import quantize_view

    monkeypatch.setattr(block_mixer, "usable", lambda mixed: True)
    calls = []
    monkeypatch.setattr("unimax.layers.gdn_block_record",
                        spied(block_mixer.gdn_block_record, "op", calls))
    model = pure_or_hybrid
    draft = quantize_view(model, "full")
    engine = unimax.UniMaxEngine(model, draft, unimax.MaxTurboGraphDecoder(draft, 4),
                                 state_safe_draft=False)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9),
                           generator=torch.Generator().manual_seed(4))
    tokens, report = engine.generate_verified(prompt, 24)
    assert torch.equal(tokens, unimax.exact_greedy_tokens(model, prompt, 24))
    assert calls and report.rejected_blocks >= 1


def test_op_names_bad_input():
    mixed = torch.randn(1, 3, 40)
    tape = (torch.zeros(1, 4, 40), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
            torch.zeros(1, 4, 4, 8), torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="mixed has 40 channels"):
        block_mixer.gdn_block_record(mixed, torch.randn(1, 3, 4), torch.randn(1, 3, 4),
                                     torch.zeros(1, 40, 4), torch.zeros(40, 4), torch.zeros(4),
                                     torch.zeros(4), *tape, False)
    short = (torch.zeros(1, 2, 64), *tape[1:])
    with pytest.raises(ValueError, match="3\\+ tokens"):
        block_mixer.gdn_block_record(torch.randn(1, 3, 64), torch.randn(1, 3, 4),
                                     torch.randn(1, 3, 4), torch.zeros(1, 64, 4),
                                     torch.zeros(64, 4), torch.zeros(4), torch.zeros(4), *short,
                                     False)


def test_verifier_view_compiles_in_one_graph_through_the_op(monkeypatch):
    """The verifier's compiled view with the op forced (inductor's CPU backend, no graph break):
    the op mutates the tape's views, which inductor must write in place, and the compiled
    recording forward leaves the logits and tape the eager one does."""
    monkeypatch.setattr(block_mixer, "usable", lambda mixed: True)
    calls = []
    monkeypatch.setattr("unimax.layers.gdn_block_record",
                        spied(block_mixer.gdn_block_record, "op", calls))
    out = verifier_recordings()
    assert calls  # (traced by the compile, called by the eager forward)
    for got, expected in zip(*out, strict=True):  # (inductor's norms round their own way)
        assert float((got - expected).float().norm() / expected.float().norm()) < 1e-5


def test_op_passes_opcheck():
    """Schema (the tape's buffers declared mutated, nothing returned), fake kernel and compiled
    dispatch: torch.library.opcheck."""
    h, hv, dk, dv = 2, 4, 8, 8
    conv_dim = 2 * h * dk + hv * dv
    proj = torch.randn(1, 5, conv_dim + hv * dv + 2 * hv)
    mixed, b = proj[..., :conv_dim], proj[..., conv_dim + hv * dv:][..., :hv]
    a = proj[..., conv_dim + hv * dv + hv:]
    tape = (torch.zeros(1, 6, conv_dim), torch.zeros(1, 6, h, dk), torch.zeros(1, 6, h, dk),
            torch.zeros(1, 6, hv, dv), torch.zeros(1, 6, hv), torch.zeros(1, 6, hv))
    torch.library.opcheck(block_mixer.gdn_block_record,
                          (mixed, a, b, torch.randn(1, conv_dim, 4), torch.randn(conv_dim, 4),
                           torch.randn(hv), torch.randn(hv), *tape, False))


COMPILE_CHILD = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimax.ops.block_mixer import TILES
from unimax.ops.short_recurrence import DEFAULT, constants, names, parse
from unimax.ops.short_recurrence_kernel import short_recurrence_kernel, tape_record_kernel

i32, bf16, f32 = "i32", "*bf16", "*fp32"
strides = ("stride_qb", "stride_qt", "stride_kb", "stride_kt", "stride_vb", "stride_vt",
           "stride_gb", "stride_gt", "stride_bb", "stride_bt")
short = dict(q=bf16, k=bf16, v=bf16, g=f32, beta=bf16, o=bf16, h0=f32, ht=f32, h_save=f32,
             ht_copy=f32, scale="fp32", **{n: i32 for n in strides})
record = dict(mixed=bf16, a=bf16, b=bf16, conv_state=bf16, conv_weight=bf16, A_log=f32,
              dt_bias=f32, tape_x=bf16, tape_q=bf16, tape_k=bf16, tape_v=bf16, tape_g=f32,
              tape_beta=bf16,
              **{n: i32 for n in ("stride_mt", "stride_at", "stride_bt", "stride_xt",
                                  "stride_qt", "stride_vt", "stride_gt")}, T=i32)


def compile(fn, sig, consts, arch, warps):
    # pointers and strides 16-divisible, as a launch at 4B heads specializes them (vectorized
    # loads change the layouts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
             if kind in (i32, bf16, f32) and name != "T"}
    sig = {**sig, **{name: "constexpr" for name in consts}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def reductions(ttgir):
    # every reduction's operand layout, by the layout's definition (names differ per module)
    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    ops = re.findall(r'"tt.reduce"\(.*?\) <\{axis = (\d+) : i32\}>.*?: \(tensor<([^>]*)>', ttgir,
                     re.S)
    return sorted({(axis, shape.split(",")[0].rsplit("x", 1)[0],
                    defs[shape.rsplit(", ", 1)[1]]) for axis, shape in ops})


for arch in (90, 89):  # H100/H200, L4
    # each launch setting (every one on sm_90, the default on sm_89): the verify block (9
    # rows, no final state), rewinds over 2 and 9 rows (final state), a 33-row block, and the
    # one-pass rewind over 9 rows (the state kept and stored twice, no outputs)
    plain = dict(SAVE_INITIAL=False, STORE_COPY=False, STORE_O=True)
    one_pass = dict(SAVE_INITIAL=True, STORE_COPY=True, STORE_O=False)
    for name in names()[1:] if arch == 90 else (DEFAULT,):
        tile = parse(name)
        layouts = [reductions(compile(short_recurrence_kernel, short,
                                      dict(STORE_FINAL=final, H=16, HV=32, K=128, V=128,
                                           **constants(tile, t, 128, 128), **more), arch,
                                      tile[1]).asm["ttgir"])
                   for t, final, more in ((9, False, plain), (2, True, plain),
                                          (9, True, plain), (33, False, plain),
                                          (9, True, one_pass))]
        print(arch, name, len(layouts[0]) > 0, all(x == layouts[0] for x in layouts))
    for bc, w in TILES:
        compiled = compile(tape_record_kernel, record,
                           dict(KD=4096, CD=8192, HV=32, W=4, BT=16, BC=bc, BH=32,
                                NEG_EIGVAL=False), arch, w)
        print(arch, "record", bc, "ex2.approx" in compiled.asm["ptx"],  # (the gates' exp)
              len(compiled.asm["cubin"]) > 0)
"""


def test_kernels_compile_for_hopper_and_ada_and_the_recurrence_has_one_layout():
    """Both kernels compile to PTX and a cubin for the H200 (sm_90) and the L4 (sm_89) at a 4B
    layer's heads without a GPU (the interpreter does not compile). And the few-token
    recurrence at each launch setting reduces in the same register layouts for the
    verify block and for rewinds of any length, with or without the final state: the
    condition for a state computed across any block boundary to round alike."""
    out = run_with_triton(COMPILE_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert rows == [row for arch in ("90", "89") for row in
                    [[arch, name, "True", "True"]
                     for name in (short.names()[1:] if arch == "90" else (short.DEFAULT,))]
                    + [[arch, "record", str(bc), "True", "True"]
                       for bc, _ in block_mixer.TILES]], out
