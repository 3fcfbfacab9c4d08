"""The Triton FP8 GEMV against its plain twin, on the CPU through Triton's interpreter (a child
process: the interpreter is chosen at import, and fla's Triton stays out of the test process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unimax.fp8 import FP8Linear, quantize_rows
from unimax.ops.fp8_gemv import fp8_gemv_ref

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import torch
from unimax.fp8 import quantize_rows
from unimax.ops.fp8_gemv import fp8_gemv, fp8_gemv_ref
torch.manual_seed(0)
for m, n, k in [(1, 100, 96), (3, 257, 1000), (1, 16, 16), (2, 33, 130)]:
    q, s = quantize_rows(torch.randn(n, k))
    x = torch.randn(m, k).to(torch.bfloat16)
    y, r = fp8_gemv(x, q, s), fp8_gemv_ref(x, q, s)
    assert y.shape == r.shape == (m, n) and y.dtype == torch.bfloat16
    err = float((y.float() - r.float()).norm() / r.float().norm())
    assert err < 1e-2, (m, n, k, err)
    print("ok", m, n, k, err)
"""


def test_triton_fp8_gemv_matches_its_twin_in_the_interpreter():
    site = os.environ.get("UNIMAX_FLA_SITE", str(ROOT / ".deps" / "fla-site"))
    if not Path(site, "triton").is_dir():
        pytest.skip("triton is not installed beside fla (.ci/run puts it in .deps/fla-site)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), site])}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("ok") == 4


def test_fp8_gemv_mode_keeps_bf16_activations():
    """fp8_gemv = FP8 weights x unquantized activations: closer to BF16 than fp8_act."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 130, bias=False)
    x = torch.randn(3, 200)
    gemv, act = FP8Linear(linear, mode="fp8_gemv"), FP8Linear(linear, mode="emulated_act")
    q, s = quantize_rows(torch.nn.functional.pad(linear.weight.detach(), (0, 8, 0, 14)))
    expected = fp8_gemv_ref(torch.nn.functional.pad(x, (0, 8)), q, s)[:, :130]
    assert torch.equal(gemv(x), expected)
    assert torch.equal(FP8Linear(linear, mode="emulated")(x), expected)  # the CPU default
    exact = linear(x)
    assert (gemv(x) - exact).norm() < (act(x) - exact).norm()
