"""bench/int4_gemv.py: the int4 format by hand and against draft_bits' rounding (the acceptance
measured there is this format's), tinygemm's scale layout through torch's CPU twin of the
kernel, and our Triton int4 GEMVs against the dequantized weight: under the interpreter (fp32
sums with and without int-to-float conversions), and every form, half2's PTX included,
compiled on a GPU."""

import sys

import pytest
import torch

from helpers import ROOT, run_with_triton

sys.path.insert(0, str(ROOT / "bench"))
import int4_gemv  # noqa: E402
from draft_bits import round_weight  # noqa: E402
from int4_gemv import check, dequantize_int4, pack_nibbles, quantize_int4  # noqa: E402


def test_int4_by_hand():
    w = torch.tensor([[0.7, -0.1, 0.0, 1.4],
                      [-3.5, 0.5, 0.25, 0.0]])
    q, scale = quantize_int4(w, 2)
    # per group of 2: absmax / 7 = 0.1, 0.2, 0.5, 0.0357...
    assert torch.allclose(scale, torch.tensor([[0.1, 0.2], [0.5, 0.25 / 7]]))
    assert q.tolist() == [[7, -1, 0, 7], [-7, 1, 7, 0]]
    assert pack_nibbles(q).tolist() == [[(7 + 8) | ((-1 + 8) << 4), 8 | (15 << 4)],
                                        [1 | (9 << 4), 15 | (8 << 4)]]
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_int4(torch.zeros(2, 6), 4)
    assert int4_gemv.parse_linear("65536x4096") == (65536, 4096)
    for bad in ("65536", "x4096", "4kx4k"):
        with pytest.raises(Exception, match="NxK"):
            int4_gemv.parse_linear(bad)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_is_draft_bits_rounding(group):
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_int4(w, group)
    assert q.abs().max() <= 7
    assert torch.allclose(dequantize_int4(q, scale), round_weight(w, 4, group), atol=1e-6)


def test_tinygemm_scale_layout_on_cpu():
    """torch's CPU int4 kernel (the CUDA one's twin: same scales_and_zeros, a plain int32
    weight) computes x @ dequantized(W).T with our scales; on the GPU bench/int4_gemv.py checks
    the CUDA kernel the same way before timing it."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 256, generator=gen).bfloat16()
    q, scale = quantize_int4(w, 64)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(q, scale).t()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, int4_gemv.scales_and_zeros(scale))
    assert check(y, ref, "cpu tinygemm") < 0.01
    with pytest.raises(AssertionError, match="relative error"):  # (a wrong scale layout)
        check(torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, 64, int4_gemv.scales_and_zeros(scale.flip(1))), ref, "flipped")


CHILD = """
import sys
import torch
sys.path.insert(0, "bench")
from int4_gemv import (check, dequantize_int4, int4_gemv, pack_nibbles, prepare_x,
                       prepare_x_launch, quantize_int4)
gen = torch.Generator().manual_seed(3)
# the prologue kernel is its torch twin bit for bit (ragged: 100 pairs over blocks of 64)
x = (torch.randn(1, 200, generator=gen) * 100).bfloat16()
assert torch.equal(prepare_x_launch(x, block=64), prepare_x(x))
print("prepare_x", prepare_x(x).shape)
# ragged: N past the last BLOCK_N, K past the last BLOCK_K (masked bytes read as q = 0)
for n, k, group, tile in [(37, 384, 32, (8, 256, 4)), (20, 640, 128, (16, 256, 4)),
                          (9, 192, 64, (4, 128, 4))]:
    w = torch.randn(n, k, generator=gen).bfloat16()
    q, scale = quantize_int4(w, group)
    x = torch.randn(1, k, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(q, scale).t()
    for form in ("triton", "magic"):
        y = int4_gemv(x, pack_nibbles(q), scale, tile, form)
        print(n, k, group, form, check(y, ref, form))
        wrong = int4_gemv(x, pack_nibbles(-q), scale, tile, form)
        assert ((wrong.float() + ref).norm() / ref.norm()) < 0.02  # (the sign is read)
# large inputs: MAGIC's 2^23 offsets leave q exact whatever x is
w = torch.randn(16, 4096, generator=gen).bfloat16()
q, scale = quantize_int4(w, 128)
x = (torch.randn(1, 4096, generator=gen) * 300).bfloat16()
ref = x.float() @ dequantize_int4(q, scale).t()
print("large", check(int4_gemv(x, pack_nibbles(q), scale, (8, 1024, 4), "magic"), ref, "magic"))
"""


def test_triton_int4_gemv_against_dequantized():
    out = run_with_triton(CHILD)
    assert len(out.strip().splitlines()) == 8


def test_int4_gemv_refuses_what_its_forms_cannot_take():
    q, scale = quantize_int4(torch.randn(8, 384), 128)
    x = torch.randn(1, 384)
    with pytest.raises(ValueError, match="form 'int3'"):
        int4_gemv.int4_gemv(x, pack_nibbles(q), scale, (8, 128, 4), "int3")
    with pytest.raises(ValueError, match="FP16 scale"):
        int4_gemv.int4_gemv(x, pack_nibbles(q), scale, (8, 128, 4), "half2")
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):  # 384 = 1.5 x 256
        int4_gemv.int4_gemv(x, pack_nibbles(q), scale.half(), (8, 256, 4), "half2")
    with pytest.raises(ValueError, match=r"half2x takes x .* got \(3, 128\)"):
        int4_gemv.int4_gemv(torch.randn(3, 128).half(), pack_nibbles(q), scale.half(),
                            (8, 128, 4), "half2x")


@pytest.mark.gpu
@pytest.mark.parametrize("form", int4_gemv.FORMS)
def test_int4_gemv_forms_on_gpu(form):
    """Each form compiled for the GPU (half2's PTX runs only there) against the dequantized
    weight: N ragged past BLOCK_N, several groups per block and one, the sign read, and x
    large (x 300: the FP16 forms' running sums, x / 64, stay finite)."""
    gen = torch.Generator().manual_seed(5)
    for n, k, group, tile, size in [(37, 1024, 128, (8, 512, 4), 1),
                                    (300, 2560, 128, (32, 128, 4), 1),
                                    (64, 512, 64, (16, 256, 4), 1),
                                    (16, 4096, 128, (8, 1024, 4), 300)]:
        q, scale = quantize_int4(torch.randn(n, k, generator=gen).bfloat16(), group)
        q, scale = q.cuda(), scale.cuda()
        s = scale.half() if form in int4_gemv.F16_SCALE else scale
        x = (torch.randn(1, k, generator=gen) * size).bfloat16().cuda()
        ref = x.float() @ dequantize_int4(q, scale).t()
        assert check(int4_gemv.int4_gemv(x, pack_nibbles(q), s, tile, form), ref, form) < 0.01
        wrong = int4_gemv.int4_gemv(x, pack_nibbles(-q), s, tile, form)
        assert ((wrong.float() + ref).norm() / ref.norm()) < 0.02
