"""The Triton GEMV (FP8 and BF16 weights) against its plain twin, on the CPU through Triton's
interpreter (a child process: the interpreter is chosen at import, and fla's Triton stays out of
the test process); the fast step's GEMV view of a model."""

import sys

import pytest
import torch

from helpers import run_with_triton
from unimax import GDNForCausalLM
from unimax.fast_step import GemvLinear, GemvRecordingMixer, GemvSwiGLUMLP, gemv_view
from unimax.fp8 import FP8Linear, quantize_rows, quantize_view
from unimax.fused_draft import FusedBlock
from unimax.layers import GatedDeltaNetMixer, GDNBlock, SwiGLUMLP
from unimax.ops.gemv import gemv_ref
from unimax.tiny import TINY_CONFIG

CHILD = """
import torch
from unimax.fp8 import quantize_rows
from unimax.ops.gemv import gemv, gemv_ref, small_m_linear
torch.manual_seed(0)
for m, n, k in [(1, 100, 96), (3, 257, 1000), (1, 16, 16), (2, 33, 130), (5, 70, 300),
                (16, 40, 64), (9, 33, 130), (17, 40, 300), (32, 33, 130),  # (dot: 32-row tiles)
                (1, 37, 192), (2, 5, 64)]:  # last two: K even
    w = torch.randn(n, k)
    q, s = quantize_rows(w)
    x = torch.randn(m, k).to(torch.bfloat16)
    for args in ((q, s), (w.to(torch.bfloat16), None)):  # FP8 with scales, BF16 without
        y, r = gemv(x, *args), gemv_ref(x, *args)
        assert y.shape == r.shape == (m, n) and y.dtype == torch.bfloat16
        err = float((y.float() - r.float()).norm() / r.float().norm())
        assert err < 1e-2, (m, n, k, err)
        assert torch.equal(small_m_linear(x, *args), y)  # the op runs the same kernel
        d = gemv(x, *args, kernel="dot")  # the tensor-core kernel takes any M <= 32
        assert float((d.float() - r.float()).norm() / r.float().norm()) < 1e-2
        if args[1] is not None and m <= 4:  # FP8: the GEMV with FP16 products
            h = gemv(x, *args, kernel="rows16")
            assert float((h.float() - r.float()).norm() / r.float().norm()) < 1e-2
        print("ok", m, n, k, err)
# each form at a tile given by hand (the timed choice's names), the widest and narrowest
from unimax.ops.gemv import TILES, tile_text
x, w = torch.randn(3, 300).to(torch.bfloat16), torch.randn(70, 300)
q, s = quantize_rows(w)
for form, tiles in TILES.items():
    for tile in (tiles[0], tiles[-1]):
        for args in ((q, s), (w.to(torch.bfloat16), None)):
            if form == "rows16" and args[1] is None:
                continue
            y, r = gemv(x, *args, kernel=f"{form}@{tile_text(tile)}"), gemv_ref(x, *args)
            assert float((y.float() - r.float()).norm() / r.float().norm()) < 1e-2
            print("tile", form, tile)
# split-K on the tensor cores ("dotsplit"): slices of K added by each tile's last program;
# K not a tile multiple, slices past K empty (K = 300 in 8 slices of 256), N not a tile multiple
from unimax.ops.gemv import DOTSPLIT_TILES, _counters
for m, n, k in ((9, 70, 1100), (5, 33, 300), (16, 40, 2048), (17, 40, 1100)):
    x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k)
    q, s = quantize_rows(w)
    for args in ((q, s), (w.to(torch.bfloat16), None)):
        r = gemv_ref(x, *args)
        for kernel in ["dotsplit"] + [f"dotsplit@{tile_text(t)}" for t in DOTSPLIT_TILES]:
            y = gemv(x, *args, kernel=kernel)
            assert float((y.float() - r.float()).norm() / r.float().norm()) < 1e-2, (m, n, kernel)
    print("dotsplit", m, n, k)
print("counters left", int(_counters(torch.device("cpu")).abs().sum()))  # all set back to 0
x, w = torch.randn(3, 300).to(torch.bfloat16), torch.randn(70, 300)
q, s = quantize_rows(w)
# the op has a fake kernel: a compiled function traces through it with no graph break
traced = torch.compile(lambda x, w, s: small_m_linear(x, w, s) * 2, fullgraph=True,
                       backend="eager")
print("compiled", float((traced(x, q, s) - 2 * gemv(x, q, s)).abs().max()))
"""


def test_triton_gemv_matches_its_twin_in_the_interpreter():
    out = run_with_triton(CHILD)
    assert out.count("ok") == 22 and "compiled 0.0" in out, out
    assert out.count("tile") == 14 and out.count("\ndotsplit ") == 4, out
    assert "counters left 0" in out, out


def test_dotsplit_is_offered_to_narrow_k_long_blocks():
    """The per-shape choice's candidates at a verifier block's M: "dotsplit" (split-K on the
    tensor cores) for the narrow, K-long weights only (a 4B out- and down-projection, not its
    in-projection or a short K), never at decode's M; cuBLAS for BF16 weights as before."""
    from unimax.ops.gemv import candidates

    assert candidates(9, False, 2560, 9216) == ("dot", "dotsplit", "cublas")
    assert candidates(9, True, 2560, 4096) == ("dot", "dotsplit")
    assert candidates(9, False, 12352, 2560) == ("dot", "cublas")
    assert candidates(9, False, 2560, 512) == ("dot", "cublas")
    assert candidates(1, False, 2560, 9216) == ("rows", "cublas")


def test_kernel_names_with_tiles():
    """The timed choice's names: every form at each of its tiles; a name with a tile that is
    not one of its form's is refused with the tiles it could have, as is an unknown form."""
    from unimax.ops.gemv import DOT_TILES, GEMV_TILES, TILES, parse_kernel, tiled_names

    names = tiled_names(("rows", "dot"), TILES)
    assert len(names) == len(GEMV_TILES) + len(DOT_TILES) and names[0] == "rows@4x512x4"
    assert all(parse_kernel(name, TILES, "gemv")[1] in TILES[name.split("@")[0]]
               for name in names)
    assert parse_kernel("dot", TILES, "gemv") == ("dot", None)
    assert parse_kernel("dot@64x256x8x3", TILES, "gemv") == ("dot", (64, 256, 8, 3))
    with pytest.raises(ValueError, match="tile '64x256x8' is not one of dot's: 16x256x4x3"):
        parse_kernel("dot@64x256x8", TILES, "gemv")
    with pytest.raises(ValueError, match="tile 'big' is not one of rows's"):
        parse_kernel("rows@big", TILES, "gemv")
    with pytest.raises(ValueError, match="gemv: kernel must be one of rows, rows16, dot"):
        parse_kernel("fast", TILES, "gemv")


def test_fp8_gemv_mode_keeps_bf16_activations():
    """fp8_gemv = FP8 weights x unquantized activations: closer to BF16 than fp8_act."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 130, bias=False)
    x = torch.randn(3, 200)
    gemv, act = FP8Linear(linear, mode="fp8_gemv"), FP8Linear(linear, mode="emulated_act")
    q, s = quantize_rows(torch.nn.functional.pad(linear.weight.detach(), (0, 8, 0, 14)))
    expected = gemv_ref(torch.nn.functional.pad(x, (0, 8)), q, s)[:, :130]
    assert torch.equal(gemv(x), expected)
    assert torch.equal(FP8Linear(linear, mode="emulated")(x), expected)  # the CPU default
    exact = linear(x)
    assert (gemv(x) - exact).norm() < (act(x) - exact).norm()


def test_gemv_view_shares_weights_and_keeps_fp8_linears():
    """The fast step's view: every plain linear becomes a GemvLinear on the same Parameter, FP8
    linears stay, an MLP whose gate-up is BF16 becomes a GemvSwiGLUMLP (tests/
    test_gemv_swiglu.py) and a GDN mixer whose in-projection is a GemvRecordingMixer on the
    same parameters, the model itself is untouched; off CUDA it computes exactly what the
    model does (F.linear)."""
    model = GDNForCausalLM.random(TINY_CONFIG, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    for source in (model, quantize_view(model, "tail")):
        view = gemv_view(source)
        for (name, original), (_, swapped) in zip(source.named_modules(), view.named_modules(),
                                                  strict=True):
            if type(original) is torch.nn.Linear:
                assert isinstance(swapped, GemvLinear), name
                assert swapped.weight is original.weight, name
            elif type(original) is SwiGLUMLP and type(original.gate_up_proj) is torch.nn.Linear:
                assert type(swapped) is GemvSwiGLUMLP, name
            elif type(original) is GatedDeltaNetMixer and \
                    type(original.in_proj) is torch.nn.Linear:
                assert type(swapped) is GemvRecordingMixer, name  # (tests/ops/test_in_proj_tape.py)
                assert swapped.A_log is original.A_log, name
            elif type(swapped) is FusedBlock:  # (a folded view's block: fused_draft)
                assert isinstance(original, GDNBlock), name
            else:
                assert type(swapped) is type(original), name
        assert torch.equal(view(ids).logits, source(ids).logits)
    assert not any(isinstance(m, GemvLinear) for m in model.modules())
    with pytest.raises(ValueError, match="bias-free"):
        GemvLinear(torch.nn.Linear(4, 4))


PTX_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import unimax.ops.gemv as g

fn = g._gemv_kernel(True, True)[1].fn
sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "N": "i32",
       "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
       "HAS_SCALE": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
       "F16": "constexpr"}
for arch in (90, 89):  # H100/H200, L4
    for f16 in (True, False):
        consts = {"HAS_SCALE": True, "BLOCK_N": 8, "BLOCK_K": 512, "F16": f16}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", arch, 32)).asm["ptx"]
        print(arch, f16, ptx.count("cvt.rn.f16x2.e4m3x2"), ptx.count("fma.rn.f16x2"),
              ptx.count("fma.rn.f32"))
"""


def test_rows16_compiles_to_packed_f16_math():
    """The reason rows16 exists, checked without a GPU: compiled for sm_90 and sm_89, its inner
    loop is packed e4m3 -> f16 conversions and packed f16 FMAs (one instruction per two
    weights each), where the fp32 GEMV converts the same way but then needs an fp32 FMA (and
    a widening) per weight."""
    out = run_with_triton(PTX_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 4
    for arch, f16, cvt, hfma2, ffma in rows:
        assert int(cvt) > 0, (arch, f16)
        if f16 == "True":
            assert int(hfma2) > 0 and int(ffma) == 0, (arch, hfma2, ffma)
        else:
            assert int(hfma2) == 0 and int(ffma) > 0, (arch, hfma2, ffma)


def test_timed_choice_times_once_and_keeps_the_fastest(monkeypatch):
    """The per-shape choice behind small_m_linear and the fused GEMVs: each candidate timed
    once per key, over copies of the weight and its scale, the fastest kept; the default (not
    kept) where nothing can be timed; a lone candidate kept untimed."""
    from unimax.ops import gemv as ops

    timed = []
    speeds = {"rows": 5.0, "rows16": 3.0, "cublas": 4.0}
    weight, scale = torch.zeros(1024, 1024, dtype=torch.float8_e4m3fn), torch.ones(1024)
    monkeypatch.setattr(ops, "_time_us",
                        lambda fn, copies, label="": sum(fn(i) for i in range(copies)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no GPU)
    monkeypatch.setattr(ops, "TIMING_SPENT", {"keys": 0, "candidates": 0, "seconds": 0.0})
    table, seen = {}, []

    def run(name, w, s):
        timed.append(name)
        seen.append((w, s))
        return speeds[name]

    names = ("rows", "rows16", "cublas")
    assert ops.timed_choice(table, ("k",), names, "rows", False, run, (weight, scale)) == "rows"
    assert table == {} and timed == []  # off CUDA: the default, nothing timed or kept
    assert ops.timed_choice(table, ("k",), names, "rows", True, run, (weight, scale)) == "rows16"
    assert ops.timed_choice(table, ("k",), names, "rows", True, run, (weight, scale)) == "rows16"
    assert table == {("k",): "rows16"} and len(timed) == 3 * 128  # timed once, over 128 copies
    assert seen[0][0] is weight and seen[1][0] is not weight  # the weight, then its clones
    assert all(torch.equal(w.view(torch.uint8), weight.view(torch.uint8)) and torch.equal(s, scale)
               for w, s in seen[:128])
    assert ops.timed_choice(table, ("one",), ("dot",), "rows", True, run) == "dot"
    assert len(timed) == 3 * 128 and table[("one",)] == "dot"
    # what the timing cost is counted (the service bench's warm-up parts): one key, 3 timed
    assert ops.TIMING_SPENT["keys"] == 1 and ops.TIMING_SPENT["candidates"] == 3
    assert ops.TIMING_SPENT["seconds"] > 0


def test_timed_choice_skips_kernels_this_gpu_cannot_run(monkeypatch):
    """A tile given by hand may not fit a smaller GPU (an L4's shared memory: Triton raises
    OutOfResources, no RuntimeError): that candidate is skipped, not the reply failed; where
    none can run, the default (the autotuned kernel, which skips such tiles itself)."""
    from unimax.ops import gemv as ops

    class OutOfResources(Exception):  # (triton.runtime.errors.OutOfResources's kind)
        pass

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "graph_us", lambda fn, copies: fn(0))
    monkeypatch.setattr(ops, "_unfit_errors", lambda: (OutOfResources,))  # (Triton's own)
    speeds = {"rows@big": None, "rows@small": 4.0, "rows16@big": None, "rows16@small": 3.0}

    def run(name, w, s):
        if speeds[name] is None:
            raise OutOfResources(f"{name}: out of resource: shared memory")
        return speeds[name]

    weights = (torch.zeros(1024, 1024), None)
    table = {}
    assert ops.timed_choice(table, ("k",), tuple(speeds), "rows", True, run, weights) == \
        "rows16@small"
    unfit = ("rows@big", "rows16@big")
    assert ops.timed_choice(table, ("none",), unfit, "rows", True, run, weights) == "rows"
    assert table[("none",)] == "rows" and ops.TIMING_ERRORS == []
    with pytest.raises(TypeError):  # a mistake in the code is no unfit tile: it is raised
        ops.timed_choice(table, ("bug",), unfit, "rows", True, lambda name: 0.0, weights)


def test_weight_copies_outgrow_the_l2_cache():
    """The choice's timer reads a weight from memory as a step does: clones that together make
    L2_SAFE_BYTES; a weight that large alone, as is; a missing scale stays missing."""
    from unimax.ops.timing import L2_SAFE_BYTES, weight_copies

    small = torch.zeros(1000, 1000, dtype=torch.bfloat16)  # 2 MB
    copies = weight_copies((small, None))
    assert len(copies) == -(-L2_SAFE_BYTES // small.nbytes) and copies[0][0] is small
    assert all(s is None and w.data_ptr() != small.data_ptr() for w, s in copies[1:])
    big = torch.zeros(L2_SAFE_BYTES, dtype=torch.uint8)
    assert len(weight_copies((big, torch.ones(4)))) == 1
    assert weight_copies(()) == [()]


def test_a_failed_graph_timing_falls_back_and_names_the_kernel(monkeypatch):
    """Where the captured-graph timing itself fails (a RuntimeError from the capture), that
    candidate is timed call by call and the failure kept in TIMING_ERRORS with the shape and
    kernel it was timing: the GPU suite asserts the list empty, and a failure must say where."""
    import types

    from unimax.ops import gemv as ops

    def graph_us(fn, copies):
        if fn(0) == "breaks":
            raise RuntimeError("operation failed due to a previous error during capture")
        return 5.0

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "graph_us", graph_us)
    monkeypatch.setattr(ops, "TIMING_ERRORS", [])
    monkeypatch.setattr(ops, "_unfit_errors", lambda: ())  # (Triton's own: none raised here)
    # the fallback's timer, triton.testing.do_bench (triton lives apart from this process)
    fake = types.SimpleNamespace(do_bench=lambda fn, **kw: 1e-3 if fn() == "breaks" else 9.0)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.testing", fake)
    run = lambda name, w, s: "breaks" if name == "rows16@a" else "fine"  # noqa: E731
    table = {}
    choice = ops.timed_choice(table, ("in_proj",), ("rows@a", "rows16@a"), "rows", True, run,
                              (torch.zeros(8, 8), None))
    assert choice == "rows16@a"  # 1 us by the fallback timer, against 5 in a graph
    assert len(ops.TIMING_ERRORS) == 1
    assert "('in_proj',) rows16@a" in ops.TIMING_ERRORS[0]
    assert "previous error during capture" in ops.TIMING_ERRORS[0]


def test_gc_paused_holds_collections_off_and_restores_the_state():
    """A capture runs with the cyclic collector off (ops.timing.gc_paused: a collection mid-
    capture that destroys a dropped graph fails the capture) and leaves it as it found it,
    also when the body raises."""
    import gc

    from unimax.ops.timing import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("capture failed")
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()  # (nested, or another thread's: the outer one still holds)
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # (someone else's pause is not ended by ours)
    finally:
        gc.enable()


def test_timed_choice_keeps_its_default_first_met_in_a_capture_when_asked(monkeypatch):
    """A key first met while a graph is being captured cannot be timed: the default, not kept
    (a later call times it), unless ``keep_default`` (ops.short_recurrence: the verify block's
    and the rewind's recurrence must stay one kernel, captured graphs included)."""
    from unimax.ops import gemv as ops

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    timed = []

    def run(name):
        timed.append(name)
        return 1.0

    table = {}
    assert ops.timed_choice(table, ("k",), ("a", "b"), "b", True, run) == "b"
    assert table == {}
    assert ops.timed_choice(table, ("k",), ("a", "b"), "b", True, run, keep_default=True) == "b"
    assert table == {("k",): "b"} and timed == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ops.timed_choice(table, ("k",), ("a", "b"), "b", True, run) == "b" and timed == []


DOT_PTX_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import unimax.ops.gemv as g

fn = g._dot_kernel(False, True)[1]
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
       "stride_wn": "i32", "stride_ym": "i32", "HAS_SCALE": "constexpr", "BLOCK_M": "constexpr",
       "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "DOT_F32": "constexpr",
       "SPLIT": "constexpr", "SWIGLU": "constexpr", "PDL": "constexpr", "PDL_LATE": "constexpr"}
cases = [(arch, rows, split, swiglu, False, False) for arch in (90, 89)  # H100/H200, L4
         for rows, split, swiglu in ((16, 1, False), (16, 4, False), (16, 1, True),
                                     (32, 1, False), (32, 4, False), (32, 1, True))]
# programmatic dependent launch (Hopper): plain, split-K and SwiGLU, the signal early and late
cases += [(90, 16, 1, False, True, False), (90, 32, 4, False, True, False),
          (90, 16, 1, True, True, True)]
for arch, rows, split, swiglu, pdl, late in cases:  # (SwiGLU: ops.gemv_swiglu)
    consts = {"HAS_SCALE": False, "BLOCK_M": rows, "BLOCK_N": 32, "BLOCK_K": 256,
              "DOT_F32": False, "SPLIT": split, "SWIGLU": swiglu, "PDL": pdl, "PDL_LATE": late}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    print(arch, split, int(swiglu), int("wgmma" in ptx or "mma.sync" in ptx),
          ptx.count("atom.global"), ptx.count("ex2.approx"), rows, int(pdl),
          ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"))
"""


def test_dotsplit_compiles_for_hopper_and_ada():
    """The tensor-core kernel compiles for sm_90 and sm_89 with and without split-K, with its
    SwiGLU epilogue, at 16 and 32 rows (ops.gemv.dot_rows; no GPU): on the tensor cores each
    way; atomics (the per-tile counters) only with slices; an exponential (the sigmoid) only
    with the epilogue; with programmatic dependent launch (PDL, sm_90) one wait and one
    signal to the next kernel, without none."""
    out = run_with_triton(DOT_PTX_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 15 and {row[6] for row in rows} == {"16", "32"}, out
    for arch, split, swiglu, mma, atomics, exps, _, pdl, waits, signals in rows:
        assert mma == "1", (arch, split, swiglu)
        assert (int(atomics) > 0) == (split == "4"), (arch, split, atomics)
        assert (int(exps) > 0) == (swiglu == "1"), (arch, swiglu, exps)
        assert (waits, signals) == (("1", "1") if pdl == "1" else ("0", "0")), out
