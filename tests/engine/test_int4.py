"""The opt-in int4 draft (unimax.int4, ops.int4_gemv) on the CPU: its storage against a hand
computation, the op's twin against the dequantized weight, the int4 view's linears, and verified
mode with it, whose output is exact greedy decoding whatever the draft. The Triton kernel (inline
PTX, GPU only) is checked against the twin in tests/gpu/test_gpu_int4.py."""

import pytest
import torch
import torch.nn.functional as F

import unimax
from unimax import GDNConfig, GDNForCausalLM, build_engine
from unimax.fp8 import FP8Linear, quantize_view
from unimax.int4 import (
    Int4Linear,
    dequantize_int4,
    dequantize_packed,
    group_for,
    pack_nibbles,
    quantize_int4,
    quantize_packed,
    unpack_nibbles,
)
from unimax.ops.int4_gemv import int4_matvec, prepare_x, tiles_for, unprepare_x
from unimax.presets import Preset, PresetError

CONFIG = GDNConfig(vocab_size=89, hidden_size=48, num_hidden_layers=2, num_k_heads=2,
                   num_v_heads=4, head_k_dim=16, head_v_dim=8, intermediate_size=80)


def test_storage_by_hand():
    w = torch.tensor([[0.7, -0.1, 0.0, 1.4],
                      [-3.5, 0.5, 0.25, 0.0]])
    q, scale = quantize_int4(w, 2)  # per group of 2: absmax / 7
    assert torch.allclose(scale, torch.tensor([[0.1, 0.2], [0.5, 0.25 / 7]]))
    assert q.tolist() == [[7, -1, 0, 7], [-7, 1, 7, 0]]
    packed = pack_nibbles(q)  # q + 8: column 2j low, 2j + 1 high
    assert packed.tolist() == [[15 | (7 << 4), 8 | (15 << 4)], [1 | (9 << 4), 15 | (8 << 4)]]
    assert torch.equal(unpack_nibbles(packed), q)
    packed16, scale16 = quantize_packed(w, 2)
    assert torch.equal(packed16, packed) and scale16.dtype == torch.float16
    assert torch.allclose(dequantize_packed(packed16, scale16), dequantize_int4(q, scale),
                          atol=1e-3)
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_int4(torch.zeros(2, 6), 4)
    assert [group_for(k) for k in (2560, 9216, 80, 48, 24)] == [128, 128, 16, 16, None]


def test_prepare_x_layout():
    x = torch.tensor([[0.0, 64.0, 128.0, -192.0, 1e9, 6.4]])
    ready = prepare_x(x)  # / 64 in FP16, even columns then odd ones, clamped at FP16's max
    assert ready.dtype == torch.float16
    assert ready.tolist() == [[0.0, 2.0, 65504.0], [1.0, -3.0, 0.0999755859375]]
    assert torch.equal(unprepare_x(ready)[0, :4], x[0, :4])


@pytest.mark.parametrize("n, k, group", [(37, 384, 128), (20, 256, 64), (9, 80, 16)])
def test_op_twin_against_the_dequantized_weight(n, k, group):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen)
    q, scale = quantize_int4(w, group)
    packed, scale16 = pack_nibbles(q), scale.half()
    x = torch.randn(1, k, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(q, scale16.float()).t()
    y = int4_matvec(prepare_x(x), packed, scale16, torch.bfloat16)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert float((y.float() - ref).norm() / ref.norm()) < 5e-3
    flipped = int4_matvec(prepare_x(x), pack_nibbles(-q), scale16, torch.float32)
    assert float((flipped + ref).norm() / ref.norm()) < 5e-3  # (the sign is read)
    assert all(k % t[1] == 0 and t[1] % group == 0 for t in tiles_for(k, group))


def test_op_names_what_it_got():
    packed, scale = quantize_packed(torch.randn(8, 256), 128)
    with pytest.raises(ValueError, match=r"as prepare_x makes it, \(2, 128\) float16"):
        int4_matvec(torch.randn(1, 256).half(), packed, scale, torch.float32)
    with pytest.raises(ValueError, match=r"scale \(N, K / group\) float16"):
        int4_matvec(prepare_x(torch.randn(1, 256)), packed, scale.float(), torch.float32)


def test_int4_linear_is_its_dequantized_weight_in_default_grad_mode():
    linear = torch.nn.Linear(256, 40, bias=False)
    int4 = Int4Linear(linear, 64)
    assert int4.weight.shape == (40, 128) and int4.weight_scale.shape == (40, 4)
    x = torch.randn(2, 3, 256, requires_grad=True)  # (no no_grad: as a caller has it)
    y = int4(x)
    assert y.shape == (2, 3, 40)
    ref = F.linear(x.detach(), dequantize_packed(int4.weight, int4.weight_scale))
    assert float((y.detach() - ref).norm() / ref.norm()) < 2e-3
    assert float((y.detach() - linear(x).detach()).norm() / ref.norm()) > 0.02  # (4 bits)
    assert int4(x[:, :0]).shape == (2, 0, 40)
    with pytest.raises(ValueError, match="bias-free"):
        Int4Linear(torch.nn.Linear(256, 4), 64)


def random_model():
    model = GDNForCausalLM(CONFIG).eval()
    model.init_random_weights(seed=3, std=0.1)
    return model


def test_the_int4_view():
    model = random_model()
    view = quantize_view(model, "int4")
    kinds = {name: type(m).__name__ for name, m in view.named_modules()
             if isinstance(m, (torch.nn.Linear, FP8Linear, Int4Linear))}
    assert kinds.pop("lm_head") == "FP8Linear"
    assert set(kinds.values()) == {"Int4Linear"} and len(kinds) == 4 * CONFIG.num_hidden_layers
    assert view.get_submodule("layers.0.mlp.down_proj").group == 16
    # the exact model keeps its own linears
    assert all(type(m) is torch.nn.Linear for name, m in model.named_modules()
               if name.endswith("_proj"))
    # the view computes what its stored weights say: the model with those weights dequantized
    dequantized = random_model()
    for name, m in view.named_modules():
        if isinstance(m, Int4Linear):
            dequantized.get_submodule(name).weight.data = dequantize_packed(m.weight,
                                                                            m.weight_scale)
        elif isinstance(m, FP8Linear):
            dequantized.get_submodule(name).weight.data = m.dequantized_weight(
                torch.float32)[:m.out_features, :m.in_features]  # (FP8's padding off)
    ids = torch.randint(0, 89, (1, 9), generator=torch.Generator().manual_seed(0))
    got, want, exact = (m(ids).logits.detach() for m in (view, dequantized, model))
    assert float((got - want).norm() / want.norm()) < 3e-3
    assert float((got - exact).norm() / exact.norm()) > 0.02


def test_verified_mode_with_the_int4_draft_is_exact():
    model = random_model()
    x = torch.randint(0, 89, (1, 12), generator=torch.Generator().manual_seed(1))
    reference = unimax.exact_greedy_tokens(model, x, 32)[0].tolist()
    engine = build_engine(model, decode="fp8", draft="int4", block_size=4)
    assert any(isinstance(m, Int4Linear) for m in engine.decode_model.modules())
    result = engine.generate(x, 32, mode="verified", draft_block=4)
    assert result.tokens == reference
    assert result.verify.drafted_tokens > 0 and result.verify.accepted_draft_tokens > 0
    with pytest.raises(ValueError, match="full-FP8 draft|state"):  # (not a fast-mode decoder)
        engine.generate(x, 4, mode="fast")


def test_int4_draft_names_are_checked():
    model = random_model()
    with pytest.raises(ValueError, match="unknown draft 'int5'; use one of tail, full, int4"):
        build_engine(model, decode="fp8", draft="int5")
    with pytest.raises(ValueError, match="unknown quantization kind 'int5'"):
        quantize_view(model, "int5")
    assert Preset(model="tiny-random", draft="int4").draft == "int4"
    with pytest.raises(PresetError, match="allowed: tail, full, int4"):
        Preset(model="tiny-random", draft="int5")


def test_a_preset_with_the_int4_draft_serves_exact_replies():
    """What a user sets: ``draft: int4`` in a preset. The service's verified mode drafts with
    int4 linears and replies the exact greedy reply; the page's header names the draft."""
    from test_service import reference_reply, reply_tokens, run, user

    from ui.page import header
    from unimax.service import EngineService, GenerationSettings

    preset = Preset(model="tiny-random", block_size=4, draft="int4",
                    generation=GenerationSettings(max_new_tokens=16))
    service = EngineService(preset).start()
    try:
        events = run(service, "one", [user("tea")], mode="verified", max_new_tokens=16)
        assert events[-1].kind == "done", events[-1].text
        draft = service.engines["verified"].decode_model
        assert any(isinstance(m, Int4Linear) for m in draft.modules())
        assert reply_tokens(service, events) == reference_reply(service, [user("tea")], 16)
        assert header(service, preset).endswith("verified draft `int4`")
    finally:
        service.stop()
