"""The fused tensor-core form for a verifier block's rows (unimax.ops.fused_dot: the fused
GEMVs' prologues and residual in ops.gemv's dot kernel, split-K and PDL as there) against the
twin, the torch forms, in Triton's interpreter; compiled to PTX for the H200 and the L4
without a GPU; its per-shape choice's candidates; and what it refuses."""

import pytest
import torch
from test_fused_draft import CASES

from helpers import run_with_triton

CHILD = CASES + """
from unimax.ops.fused_dot import fused_dot
from unimax.ops.fused_gemv import _counters
torch.manual_seed(0)
# (dtype, m, n, k, head, kernels): the default tiles of both forms, and split-K at tiles whose
# slices are some full, one short and some empty (K = 640 in slices of 256 or 128)
RUNS = [(torch.float32, 5, 100, 128, 32, ("dot", "dotsplit")),
        (torch.float32, 9, 70, 640, 64, ("dotsplit@16x256x4x3x8", "dotsplit@64x128x4x4x8")),
        (torch.bfloat16, 9, 70, 256, 64, ("dot", "dot@16x256x4x3")),
        (torch.bfloat16, 16, 33, 640, 128, ("dotsplit@16x256x4x3x8",)),
        (torch.bfloat16, 17, 40, 128, 64, ("dot",))]
for dtype, m, n, k, head, kernels in RUNS:
    for prologue, args, ref in cases(dtype, m, n, k, head):
        for kernel in kernels:
            y = fused_dot(*args, kernel=kernel)
            err = rel(y, ref)
            assert y.shape == ref.shape == (m, n) and y.dtype == dtype
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (
                dtype, m, n, k, prologue, args[8] is None, kernel, err)
    print("ok", dtype, m, n, k)
print("counters left", int(_counters(torch.device("cpu")).abs().sum()))  # all set back to 0
# the RMS pre-pass in slices: a row longer than RK
x, norm, w = torch.randn(6, 300), 1 + 0.1 * torch.randn(300), torch.randn(8, 300)
ref = fused_small_m_linear_ref(x, w, None, 8, 300, "rms", norm, None, None, 1e-6, 0.0)
print("long", rel(fused_dot(x, w, None, 8, 300, "rms", norm, None, None, 1e-6, 0.0), ref))
"""


def test_fused_dot_matches_the_twin_in_the_interpreter():
    """Every prologue, with and without the residual, FP8 weights with scales and plain ones
    (padded past (n, k) as an FP8Linear's are), 5 to 17 rows, "dot" and split-K "dotsplit" at
    several tiles: the torch forms' output (fp32 within 1e-5, BF16 within 2e-2), the split
    counters all set back."""
    out = run_with_triton(CHILD)
    assert out.count("ok") == 5 and "counters left 0" in out, out
    assert float(out.split("long")[1]) < 1e-5, out


PTX_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimax.ops.fused_dot_kernels import fused_dot_kernel

sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16",
       "s_ptr": "*fp32", "r_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
       "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
       "stride_zm": "i32", "stride_wn": "i32", "stride_rm": "i32", "stride_ym": "i32",
       "eps": "fp32", "offset": "fp32", **dict.fromkeys(
           ("PRO", "HEAD", "HAS_SCALE", "HAS_RES", "BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT_F32",
            "RK", "SPLIT", "PDL", "PDL_LATE"), "constexpr")}
for arch in (90, 89):
    for pro in range(6):
        for fp8 in (False, True):
            for split, pdl in ((1, False), (4, False), (1, True), (4, True)):
                if pdl and arch == 89:  # (no programmatic launch below sm_90)
                    continue
                consts = {"PRO": pro, "HEAD": 128 if pro in (2, 3) else 1, "HAS_SCALE": fp8,
                          "HAS_RES": pro % 2 == 0, "BLOCK_M": 16, "BLOCK_N": 32,
                          "BLOCK_K": 256, "DOT_F32": False, "RK": 512, "SPLIT": split,
                          "PDL": pdl, "PDL_LATE": False}
                signature = {**sig, "w_ptr": "*fp8e4nv" if fp8 else "*bf16"}
                ptx = triton.compile(ASTSource(fn=fused_dot_kernel, signature=signature,
                                               constexprs=consts),
                                     target=GPUTarget("cuda", arch, 32)).asm["ptx"]
                mma = ptx.count("wgmma") + ptx.count("mma.sync")
                print(arch, pro, int(fp8), split, int(pdl), int(mma > 0),
                      ptx.count("atom.global") > 0, ptx.count("griddepcontrol"))
"""


def test_fused_dot_compiles_for_hopper_and_ada():
    """Every prologue compiles to PTX for sm_90 and sm_89 without a GPU (the interpreter does
    not compile: a reshape or a layout Triton cannot lower shows here), BF16 and FP8 weights,
    on the tensor cores, with split-K's atomics where split, and with PDL one wait and one
    signal (none without)."""
    out = run_with_triton(PTX_CHILD, interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert len(rows) == 6 * 2 * (4 + 2), out
    for arch, pro, fp8, split, pdl, mma, atomics, pdl_ops in rows:
        assert mma == "1", (arch, pro, fp8, split, pdl)
        assert atomics == str(split == "4"), (arch, pro, split, atomics)
        assert pdl_ops == ("2" if pdl == "1" else "0"), (arch, pro, pdl, pdl_ops)


def test_fused_dot_candidates_and_bad_input(monkeypatch):
    """The per-shape choice times the plain GEMM's own choice for the shape (its tile, BLOCK_K
    widened to a head) beside each form's default (split-K where it fits), no name twice; and
    the form refuses rows outside its range and tiles not its own, naming them."""
    from unimax.ops import fused_dot, gemv

    x = torch.zeros(9, 4096)
    w = torch.zeros(2560, 4096)
    for plain, want in (("dotsplit@32x256x4x3x8", ("dotsplit@32x256x4x3x8", "dot@64x256x4x3",
                                                   "dotsplit@32x256x4x3x4")),
                        ("dot@64x128x4x4", ("dot@64x128x4x4", "dot@64x256x4x3",
                                            "dotsplit@32x256x4x3x4")),
                        ("dot@64x256x4x3", ("dot@64x256x4x3", "dotsplit@32x256x4x3x4")),
                        ("cublas", ("dot@64x256x4x3", "dotsplit@32x256x4x3x4"))):
        monkeypatch.setattr(gemv, "choose", lambda *a, plain=plain: plain)
        assert fused_dot.candidates(x, w, None, 2560, 4096, 1) == want, plain
    # a gated prologue's head (256) widens BLOCK_K; a wide weight: no split-K
    monkeypatch.setattr(gemv, "choose", lambda *a: "dot@64x128x4x4")
    assert fused_dot.candidates(x, torch.zeros(8192, 4096), None, 8192, 4096, 256) == (
        "dot@64x256x4x4", "dot@64x256x4x3")
    with pytest.raises(ValueError, match="takes 5 to 32 rows, got 4"):
        fused_dot.fused_dot(torch.zeros(4, 64), torch.zeros(8, 64), None, 8, 64, "none")
    with pytest.raises(ValueError, match="tile '8x8' is not one of dot's"):
        fused_dot.fused_dot(torch.zeros(9, 64), torch.zeros(8, 64), None, 8, 64, "none",
                            kernel="dot@8x8")
    with pytest.raises(ValueError, match="prologue must be one of"):
        fused_dot.fused_dot(torch.zeros(9, 64), torch.zeros(8, 64), None, 8, 64, "nope")
