"""Write a GDNForCausalLM as a checkpoint folder in the Qwen3.5 text layout (config.json +
model.safetensors), the inverse of the loader: what transformers' Qwen3_5ForCausalLM and
``unimax.load_model`` both read. Used by the built-in tiny model and the demo-model trainer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .model import GDNForCausalLM


def qwen3_5_tensors(model: GDNForCausalLM) -> dict[str, torch.Tensor]:
    """Our merged weights split back into Qwen3.5's tensor names."""
    cfg = model.config
    if cfg.has_attention:
        raise NotImplementedError("exporting hybrid (attention) models is not supported yet")
    out = {"model.embed_tokens.weight": model.embed_tokens.weight,
           "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
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
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in out.items()}


def qwen3_5_config(model: GDNForCausalLM, **extra) -> dict:
    cfg = model.config
    if cfg.norm_offset != 1.0:
        raise ValueError("the Qwen3.5 layout scales its norms by 1 + w: export a model built "
                         "with norm_offset=1.0")
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": ["linear_attention"] * cfg.num_hidden_layers,
        "linear_num_key_heads": cfg.num_k_heads, "linear_num_value_heads": cfg.num_v_heads,
        "linear_key_head_dim": cfg.head_k_dim, "linear_value_head_dim": cfg.head_v_dim,
        "linear_conv_kernel_dim": cfg.conv_size, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        # transformers' config requires attention sizes even when no layer uses them
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        **extra,
    }


def save_checkpoint(model: GDNForCausalLM, path: str | Path, dtype: torch.dtype | None = None,
                    max_shard_mb: float | None = None, **extra_config) -> str:
    """Write config.json and the weights (model.safetensors, or shards of at most max_shard_mb
    with transformers' model.safetensors.index.json); returns ``weights_sha256``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = qwen3_5_tensors(model)
    if dtype is not None:
        tensors = {k: v if k.endswith(("A_log", "dt_bias")) else v.to(dtype)
                   for k, v in tensors.items()}
    shards = _shards(tensors, max_shard_mb)
    if len(shards) == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, path / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(qwen3_5_config(model, **extra_config),
                                                 indent=1))
    return weights_sha256(path)


def _shards(tensors: dict[str, torch.Tensor], max_shard_mb: float | None) -> list[list[str]]:
    if max_shard_mb is None:
        return [list(tensors)]
    limit, shards, size = max_shard_mb * 2**20, [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def weights_sha256(path: str | Path) -> str:
    """sha256 over the folder's *.safetensors files in name order (for one file: its sha256)."""
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
