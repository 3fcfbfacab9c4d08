"""Logits of checkpoints written by the reference libraries equal the references' own logits."""

import pytest
import torch

import unimax
from helpers import fla_site, rel_err, run_fla_script, write_qwen_checkpoint

TOL = 1e-4


def ids(batch, length, vocab, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie,v_heads,length", [(True, 4, 70), (False, 2, 9), (True, 2, 130)])
def test_qwen3_5_text_matches_transformers(tmp_path, tie, v_heads, length):
    hf = write_qwen_checkpoint(tmp_path, seed=1, tie=tie, v_heads=v_heads)
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    x = ids(2, length, 97)
    with torch.no_grad():
        expected = hf(input_ids=x, use_cache=False).logits
        got = model(input_ids=x).logits
    assert rel_err(got, expected) < TOL
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie


def test_sharded_checkpoint(tmp_path):
    hf = write_qwen_checkpoint(tmp_path, seed=2, tie=False)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    x = ids(1, 20, 97)
    with torch.no_grad():
        assert rel_err(model(input_ids=x).logits, hf(input_ids=x, use_cache=False).logits) < TOL


def test_qwen3_5_vlm_checkpoint_language_model(tmp_path):
    """The VLM class's checkpoint keeps the text model under model.language_model.*."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from helpers import qwen_text_config, randomize_

    text = qwen_text_config(tie=True).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)).eval()
    randomize_(vlm, 3)
    vlm.save_pretrained(tmp_path)
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    x = ids(1, 25, 97)
    with torch.no_grad():
        expected = vlm(input_ids=x, use_cache=False).logits
        got = model(input_ids=x).logits
    assert rel_err(got, expected) < TOL


FLA_CONFIGS = [
    dict(hidden_size=64, num_heads=2, num_v_heads=4, head_dim=16, expand_v=1,
         num_hidden_layers=2, vocab_size=100),
    dict(hidden_size=64, num_heads=2, head_dim=16, expand_v=2, num_hidden_layers=3,
         vocab_size=90, tie_word_embeddings=True, allow_neg_eigval=True,
         output_gate_activation="sigmoid", intermediate_size=80),
]


@pytest.mark.skipif(fla_site() is None, reason="set UNIMAX_FLA_SITE to a folder holding fla "
                    "(.ci/run does)")
@pytest.mark.parametrize("config", FLA_CONFIGS)
def test_fla_checkpoint_matches_fla_model(tmp_path, config):
    x = ids(2, 75, config["vocab_size"])
    import json

    run_fla_script([str(tmp_path), "5", json.dumps(config), json.dumps(x.tolist())])
    expected = torch.load(tmp_path / "reference_logits.pt")
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    assert model.config.source_layout == "fla"
    with torch.no_grad():
        got = model(input_ids=x).logits
    assert rel_err(got, expected) < TOL


def test_bf16_load_keeps_gate_params_fp32(tmp_path):
    write_qwen_checkpoint(tmp_path, seed=4)
    model = unimax.load_model(tmp_path, device="cpu", dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].mixer.A_log.dtype == torch.float32
    x = ids(1, 12, 97)
    with torch.no_grad():
        ref = unimax.load_model(tmp_path, device="cpu", dtype="float32")(input_ids=x).logits
        got = model(input_ids=x).logits
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), ref) < 5e-2
