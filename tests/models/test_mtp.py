"""Qwen3.5's MTP module (unimax.mtp): a checkpoint in Qwen3.5's naming with ``mtp.*`` weights
loads it, and its forward equals a reference built from transformers' own Qwen3.5 parts (the
gated-attention decoder layer, the (1 + w) RMSNorm, the rotary embedding) composed as the public
MTP implementations compose them (vLLM's qwen3_5_mtp.py: both inputs normed, the embedding's
half first, fc, the layer, the output norm); the model's hidden state it reads equals
transformers' last hidden state; with its own KV, token by token, it equals the whole
sequence. A checkpoint without MTP weights loads as before."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import unimax
from helpers import qwen_text_config, randomize_, rel_err, write_qwen_checkpoint

TOL = 1e-5
HYBRID = ["linear_attention", "full_attention"]


class ReferenceMTP(nn.Module):
    """The MTP module from transformers' Qwen3.5 parts; its parameter names are the
    checkpoint's under ``mtp.``."""

    def __init__(self, text_config):
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
            Qwen3_5TextRotaryEmbedding,
        )

        super().__init__()
        one = Qwen3_5TextConfig(**{**text_config.to_dict(), "num_hidden_layers": 1,
                                   "layer_types": ["full_attention"]})
        one._attn_implementation = "eager"
        hidden, eps = one.hidden_size, one.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(one, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(one)

    def forward(self, hidden, embeds, start: int = 0):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        batch, tokens, _ = x.shape
        positions = torch.arange(start, start + tokens)[None].expand(batch, -1)
        causal = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=self.rotary(x, positions),
                           attention_mask=causal.expand(batch, 1, -1, -1))
        return self.norm(x)


def write_mtp_checkpoint(path, seed: int, layer_types=HYBRID, tie=True, prefix="mtp."):
    """A Qwen3.5 text checkpoint written by transformers, its MTP tensors (which
    transformers' model does not hold) added in a safetensors file of their own, as Qwen's
    releases ship them, and ``mtp_num_hidden_layers`` 1 in its config."""
    hf = write_qwen_checkpoint(path, seed=seed, num_layers=len(layer_types),
                               layer_types=layer_types, tie=tie)
    reference = ReferenceMTP(qwen_text_config(num_layers=len(layer_types),
                                              layer_types=layer_types, tie=tie))
    randomize_(reference, seed + 100)
    save_file({prefix + name: t.contiguous() for name, t in reference.state_dict().items()
               if "rotary" not in name}, path / "mtp.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return hf.eval(), reference.eval()


@pytest.mark.parametrize("layer_types, tie", [(HYBRID, True), (["linear_attention"] * 2, False)])
def test_mtp_forward_matches_the_reference(tmp_path, layer_types, tie):
    hf, reference = write_mtp_checkpoint(tmp_path, seed=3, layer_types=layer_types, tie=tie)
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    assert model.config.mtp_layers == 1 and model.mtp is not None
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=x, return_hidden=True)  # default grad mode, as users call it
    with torch.no_grad():
        hf_hidden = hf.model(input_ids=x, use_cache=False).last_hidden_state
        hf_logits = hf(input_ids=x, use_cache=False).logits
    # the hidden state the MTP reads: the model's after its final norm (the LM head's input)
    assert rel_err(out.hidden, hf_hidden) < TOL and rel_err(out.logits, hf_logits) < 1e-4
    # the MTP at positions 0 .. T - 2: h_t and the token t + 1's embedding, predicting t + 2
    hidden, embeds = out.hidden[:, :-1], model.embed_tokens(x[:, 1:])
    got = model.mtp(hidden, embeds)
    with torch.no_grad():
        want = reference(hidden, embeds)
    assert rel_err(got, want) < TOL
    assert rel_err(model.lm_head(got), hf.lm_head(want)) < TOL


def test_mtp_with_its_kv_equals_the_whole_sequence(tmp_path):
    """Through its own KV (a prompt's positions at once, then one position a step, as drafts
    chain), the MTP gives the whole sequence's outputs; a rejected draft is undone by setting
    its position back, the entries past it never read."""
    _, reference = write_mtp_checkpoint(tmp_path, seed=4)
    model = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 10, 64, generator=gen)
    embeds = model.embed_tokens(torch.randint(0, 97, (1, 10), generator=gen))
    with torch.no_grad():
        whole = model.mtp(hidden, embeds)
        assert rel_err(whole, reference(hidden, embeds)) < TOL
        cache = model.mtp.make_cache()
        parts = [model.mtp(hidden[:, :6], embeds[:, :6], cache)]
        junk = torch.randn(1, 3, 64, generator=gen)  # drafts later rejected
        model.mtp(junk, junk, cache)
        cache.position.fill_(6)
        cache.seen_tokens = 6
        for t in range(6, 10):
            parts.append(model.mtp(hidden[:, t:t + 1], embeds[:, t:t + 1], cache))
    assert rel_err(torch.cat(parts, dim=1), whole) < TOL
    assert cache.seen_tokens == int(cache.position) == 10


def test_mtp_tensors_under_the_text_models_prefix_load_too(tmp_path):
    write_mtp_checkpoint(tmp_path, seed=5, prefix="model.mtp.")
    assert unimax.load_model(tmp_path, device="cpu").mtp is not None


def test_a_checkpoint_without_mtp_weights_loads_as_before(tmp_path):
    """transformers' own saves drop the MTP tensors: the config may still name the layer."""
    write_qwen_checkpoint(tmp_path, seed=6, num_layers=2, layer_types=HYBRID)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    model = unimax.load_model(tmp_path, device="cpu")
    assert model.mtp is None and model.config.mtp_layers == 0
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())


def test_mtp_inputs_of_the_wrong_shape_are_named(tmp_path):
    write_mtp_checkpoint(tmp_path, seed=7)
    model = unimax.load_model(tmp_path, device="cpu")
    with pytest.raises(ValueError, match=r"must both be \(B, T, hidden\)"):
        model.mtp(torch.zeros(1, 3, 64), torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="mtp_layers must be 0 or 1"):
        unimax.GDNConfig(**{**model.config.__dict__, "mtp_layers": 2})
