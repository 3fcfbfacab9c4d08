"""The memory plan (unimax.memory): its parts equal what the engines really hold (the shared
exact side's KV and quantized linears, counted from the built objects), and a preset that
cannot fit is refused with the settings to lower."""

import dataclasses

import pytest
import torch

import unimax
from helpers import write_qwen_checkpoint
from unimax import memory
from unimax.build import build_engine
from unimax.exact import ExactSide
from unimax.presets import Preset

HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("draft", ["tail", "full", "int4"])
def test_the_plan_counts_what_the_modes_build(tmp_path, draft):
    write_qwen_checkpoint(tmp_path, seed=1, num_layers=4, layer_types=HYBRID, vocab=259)
    model = unimax.load_model(tmp_path, dtype="bfloat16", max_context=512)
    preset = Preset(model=str(tmp_path), max_context=512, draft=draft, state_memory_mib=64,
                    prefill_chunk=256)
    parts = {part.name: part.bytes for part in memory.plan(model, preset)}
    exact = ExactSide(model)
    for decode, view in (("bf16", "tail"), ("fp8", "tail"), ("fp8", draft)):
        build_engine(model, decode=decode, draft=view, exact=exact)
    quantized = {id(t): t for m in exact.quantized.values() for t in m.buffers()}
    assert parts["FP8 / int4 copies (speed tail, verified draft)"] == nbytes(quantized.values())
    assert parts["attention KV buffers"] == nbytes(unimax.cache.kv_tensors(exact.cache)) > 0
    assert parts["weights"] == nbytes([*model.parameters(), *model.buffers()])
    assert parts["kept conversation states, at most"] == 64 * 2**20


def test_a_preset_that_cannot_fit_is_refused_with_what_to_lower():
    parts = [memory.Part("weights", 8 * 10**9, "a smaller model"),
             memory.Part("FP8 copies", 4 * 10**9, "draft: tail"),
             memory.Part("attention KV buffers", 10**9, "max_context"),
             memory.Part("kept conversation states, at most", 6 * 10**9, "state_memory_mib")]
    memory.check(parts, 20 * 10**9)  # 19.5 GB with the headroom: fits
    with pytest.raises(memory.MemoryPlanError) as err:
        memory.check(parts, 16 * 10**9)
    text = str(err.value)
    assert "needs about 19.5 GB" in text and "leaves 16.0 GB" in text
    # the largest parts a setting shrinks, largest first
    assert text.index("a smaller model") < text.index("state_memory_mib") < \
        text.index("draft: tail")


def test_the_qwen35_4b_l4_preset_plan():
    """The shipped L4 preset on the Qwen3.5-4B shape (built on the meta device: no memory):
    the plan as the preset's comment states it, and it fits an L4."""
    from unimax.config import GDNConfig
    from unimax.model import GDNForCausalLM
    from unimax.presets import load_preset

    preset = load_preset("presets/qwen3.5-4b-l4.yaml")
    layers = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(32))
    cfg = GDNConfig(vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_k_heads=16,
                    num_v_heads=32, head_k_dim=128, head_v_dim=128, intermediate_size=9216,
                    layer_types=layers, num_attention_heads=16, num_key_value_heads=4,
                    attn_head_dim=256, max_context=preset.max_context,
                    tie_word_embeddings=True)
    with torch.device("meta"):
        model = GDNForCausalLM(cfg).to(torch.bfloat16)
    model.lm_head.weight = model.embed_tokens.weight
    gb = {p.name: round(p.bytes / 1e9, 2) for p in memory.plan(model, preset)}
    assert gb["weights"] == pytest.approx(8.4, abs=0.1)
    assert gb["FP8 / int4 copies (speed tail, verified draft)"] == pytest.approx(4.2, abs=0.1)
    assert gb["attention KV buffers"] == pytest.approx(0.27, abs=0.01)
    tail = dataclasses.replace(preset, draft="tail")
    assert [p.bytes for p in memory.plan(model, tail)][1] / 1e9 == pytest.approx(0.71, abs=0.02)
    memory.check(memory.plan(model, preset), int(23.5e9))  # an L4
    with pytest.raises(memory.MemoryPlanError, match="lower"):
        memory.check(memory.plan(model, preset), 16 * 2**30)  # a 16 GB card
