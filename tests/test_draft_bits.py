"""bench/draft_bits.py: its rounding against a hand computation, its format names, and a lowered
draft in a verified engine (whatever the draft, the output is exact greedy decoding)."""

import sys

import pytest
import torch

import unimax
from helpers import ROOT
from unimax import GDNConfig, GDNForCausalLM, build_engine
from unimax.fp8 import FP8Linear

sys.path.insert(0, str(ROOT / "bench"))
from draft_bits import (  # noqa: E402
    fit_scale,
    lower_the_draft,
    parse_format,
    parse_skip,
    round_weight,
    skip_in_the_draft,
)

CONFIG = GDNConfig(vocab_size=89, hidden_size=48, num_hidden_layers=2, num_k_heads=2,
                   num_v_heads=4, head_k_dim=16, head_v_dim=8, intermediate_size=80)


def test_rounding_by_hand():
    w = torch.tensor([[1.0, -0.5, 0.25, 3.5, 0.1],
                      [0.0, 0.0, 0.0, 0.0, -2.0]])
    # int3 (levels -3..3), one scale per row: 3.5 / 3 and 2 / 3
    s = 3.5 / 3
    expected = torch.tensor([[round(1.0 / s) * s, round(-0.5 / s) * s, 0.0, 3.5, 0.0],
                             [0.0, 0.0, 0.0, 0.0, -2.0]])
    assert torch.allclose(round_weight(w, 3, None), expected)
    # groups of 2 columns (the last one padded): scales 1/3, 3.5/3, 0.1/3 in row 0 (-0.5 is
    # -1.5 steps, which rounds to the even -2)
    got = round_weight(w, 3, 2)
    assert torch.allclose(got[0], torch.tensor([1.0, -2 / 3, 0.0, 3.5, 0.1]))
    assert torch.allclose(got[1], w[1])
    # int8 per row is close, int4 per row is not, for a normal weight
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    err = {bits: float((round_weight(x, bits, None) - x).norm() / x.norm()) for bits in (8, 4)}
    assert err[8] < 0.01 < err[4] < 0.2
    assert float((round_weight(x, 4, 32) - x).norm() / x.norm()) < err[4]


def test_the_fit_takes_the_extra_level_on_either_side_by_hand():
    # Both groups lie on a grid of step 0.5 with 16 levels: the largest weight of the first is
    # negative (q -8, a positive scale), of the second positive (a negative scale, whose -8
    # stands for +4): the fit rounds both exactly, where absmax / 7 cannot.
    w = torch.tensor([[-4.0, 0.5, 1.0, 3.5, 4.0, -0.5, -1.0, -3.5]])
    assert fit_scale(w.reshape(1, 2, 4), 4).flatten().tolist() == [0.5, -0.5]
    assert torch.equal(round_weight(w, 4, 4, fit=True), w)
    assert float((round_weight(w, 4, 4) - w).abs().max()) > 0.1


@pytest.mark.parametrize("seed", range(3))
def test_the_fit_rounds_every_group_no_worse_than_absmax(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen)
    w[:, ::97] *= 8  # (outliers: a few large weights per row, as real checkpoints have)
    errors = {fit: ((round_weight(w, 4, 128, fit) - w).reshape(64, 4, 128) ** 2).sum(-1)
              for fit in (False, True)}
    assert bool((errors[True] <= errors[False] * (1 + 1e-6)).all())
    assert float(errors[True].sum()) < 0.8 * float(errors[False].sum())


def test_format_names():
    assert parse_format("fp8") is None
    assert parse_format("int8") == (8, None, False)
    assert parse_format("int4/64") == (4, 64, False)
    assert parse_format("int4/128+fit") == (4, 128, True)
    assert parse_format("int3+fit") == (3, None, True)
    for bad in ("int", "fp4", "int4/x", "int9", "int4/0", "int1", "int4+mse", "int4/+fit"):
        with pytest.raises(ValueError, match="int"):
            parse_format(bad)
    assert parse_format("skip:1") is None
    assert parse_skip("skip:1,3") == ("layer", [1, 3])
    assert parse_skip("skipmlp:0") == ("mlp", [0])
    assert parse_skip("int4") is None
    for bad in ("skip:", "skip:a", "skipmlp:1,,2"):
        with pytest.raises(ValueError, match="layers to skip"):
            parse_skip(bad)


def test_a_skipped_layer_adds_nothing_and_decoding_stays_exact():
    model = GDNForCausalLM(CONFIG).eval()
    model.init_random_weights(seed=3, std=0.1)
    x = torch.randint(0, 89, (1, 12), generator=torch.Generator().manual_seed(1))
    reference = unimax.exact_greedy_tokens(model, x, 24)[0].tolist()
    engine = build_engine(model, decode="fp8", draft="full", block_size=4)
    with pytest.raises(ValueError, match="layers must be 0..1"):
        skip_in_the_draft(engine, "layer", [2])
    assert skip_in_the_draft(engine, "mlp", [0]) == 1
    assert skip_in_the_draft(engine, "layer", [1]) == 2
    view = engine.decode_model
    h = torch.randn(1, 3, CONFIG.hidden_size, dtype=view.layers[1].mlp.down_proj.weight.dtype)
    for name in ("layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "layers.1.mixer.out_proj"):
        linear = view.get_submodule(name)
        assert not isinstance(linear, FP8Linear)
        assert linear(torch.randn(1, 3, linear.in_features, dtype=h.dtype)).abs().max() == 0
    assert isinstance(view.get_submodule("layers.0.mixer.out_proj"), FP8Linear)
    assert isinstance(model.get_submodule("layers.1.mlp.down_proj"), torch.nn.Linear)  # exact
    assert model.get_submodule("layers.1.mlp.down_proj").weight.abs().max() > 0
    result = engine.generate(x, 24, mode="verified", draft_block=4)
    assert result.tokens == reference
    assert result.verify.rejected_blocks > 0  # a draft without a layer and an MLP is wrong


@pytest.mark.parametrize("head", [True, False])
def test_a_lowered_draft_still_decodes_exactly(head):
    model = GDNForCausalLM(CONFIG).eval()
    model.init_random_weights(seed=3, std=0.1)
    x = torch.randint(0, 89, (1, 12), generator=torch.Generator().manual_seed(1))
    reference = unimax.exact_greedy_tokens(model, x, 24)[0].tolist()
    engine = build_engine(model, decode="fp8", draft="full", block_size=4)
    before = sum(isinstance(m, FP8Linear) for m in engine.decode_model.modules())
    lowered = lower_the_draft(engine, model, 2, 16, head=head)
    assert lowered == before - (not head)
    kept = [name for name, m in engine.decode_model.named_modules() if isinstance(m, FP8Linear)]
    assert kept == ([] if head else ["lm_head"])
    assert not any(isinstance(m, FP8Linear) for m in model.modules())  # (the view's own)
    result = engine.generate(x, 24, mode="verified", draft_block=4)
    assert result.tokens == reference
    assert result.verify.rejected_blocks > 0  # a 2-bit draft is wrong somewhere
