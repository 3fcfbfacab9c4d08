"""A built-in tiny random model, ``tiny-random``: a real checkpoint folder (Qwen3.5 text layout,
safetensors, config.json, byte-level tokenizer with a chat template) written locally with no
download. It proves the plumbing end to end on any machine; its text is noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import GDNConfig
from .model import GDNForCausalLM

TINY_NAME = "tiny-random"
TINY_VERSION = 3  # bump when the recipe changes, so cached folders are rebuilt
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_CONFIG = GDNConfig(vocab_size=256 + len(SPECIAL_TOKENS), hidden_size=128,
                        num_hidden_layers=4, num_k_heads=2, num_v_heads=4, head_k_dim=32,
                        head_v_dim=32, intermediate_size=256, norm_offset=1.0,
                        tie_word_embeddings=True, source_layout="qwen3_5")


def tiny_dir() -> Path:
    base = Path(os.environ.get("UNIMAX_CACHE", Path.home() / ".cache" / "unimax"))
    return base / f"{TINY_NAME}-v{TINY_VERSION}"


def _qwen_tensors(model: GDNForCausalLM) -> dict[str, torch.Tensor]:
    """Our merged weights split back into Qwen3.5's tensor names (the loader's inverse)."""
    cfg = model.config
    out = {"model.embed_tokens.weight": model.embed_tokens.weight,
           "model.norm.weight": model.norm.weight}
    for i, block in enumerate(model.layers):
        src, attn = f"model.layers.{i}.", f"model.layers.{i}.linear_attn."
        qkv, z, b, a = block.mixer.in_proj.weight.split(
            [cfg.conv_dim, cfg.value_dim, cfg.num_v_heads, cfg.num_v_heads])
        gate, up = block.mlp.gate_up_proj.weight.split(cfg.intermediate_size)
        out.update({
            src + "input_layernorm.weight": block.mixer_norm.weight,
            attn + "in_proj_qkv.weight": qkv, attn + "in_proj_z.weight": z,
            attn + "in_proj_b.weight": b, attn + "in_proj_a.weight": a,
            attn + "conv1d.weight": block.mixer.conv_weight.unsqueeze(1),
            attn + "A_log": block.mixer.A_log, attn + "dt_bias": block.mixer.dt_bias,
            attn + "norm.weight": block.mixer.norm.weight,
            attn + "out_proj.weight": block.mixer.out_proj.weight,
            src + "post_attention_layernorm.weight": block.mlp_norm.weight,
            src + "mlp.gate_proj.weight": gate, src + "mlp.up_proj.weight": up,
            src + "mlp.down_proj.weight": block.mlp.down_proj.weight,
        })
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def _write_tokenizer(path: Path) -> None:
    """Byte-level BPE with no merges: every byte is a token, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_random(path: Path | None = None, seed: int = 0) -> Path:
    """Write (once) and return the tiny random checkpoint folder."""
    path = Path(path) if path is not None else tiny_dir()
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(tmp)
    model = GDNForCausalLM.random(TINY_CONFIG, seed=seed)
    with torch.no_grad():
        # Tied head: favour letters and the space, so the noise it prints is visible text.
        from transformers import AutoTokenizer

        vocab = AutoTokenizer.from_pretrained(tmp).get_vocab()
        visible = [vocab[c] for c in "abcdefghijklmnopqrstuvwxyz" + "\u0120" if c in vocab]
        scale = torch.full((TINY_CONFIG.vocab_size, 1), 0.05)
        scale[visible] = 10.0
        model.embed_tokens.weight.mul_(scale)
    tensors = _qwen_tensors(model)
    tensors.pop("lm_head.weight", None)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = TINY_CONFIG
    config = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": ["linear_attention"] * cfg.num_hidden_layers,
        "linear_num_key_heads": cfg.num_k_heads, "linear_num_value_heads": cfg.num_v_heads,
        "linear_key_head_dim": cfg.head_k_dim, "linear_value_head_dim": cfg.head_v_dim,
        "linear_conv_kernel_dim": cfg.conv_size, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": True, "eos_token_id": 256 + 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "unimax_note": "tiny random model built locally by unimax.tiny; its text is noise",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    if not (path / "config.json").is_file():
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return path
