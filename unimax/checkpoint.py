"""Load a GDN checkpoint (config.json + safetensors) from a folder or a hub id, in either layout.

Layouts (docs/design.md, "Checkpoint layouts"):
- flash-linear-attention ``gated_deltanet``: separate q/k/v/g/a/b projections and q/k/v convs,
  RMSNorms scaled by w;
- Qwen3.5 text (``qwen3_5_text``, or ``qwen3_5`` VLM checkpoints under
  ``model.language_model.``), every layer ``linear_attention``: fused qkv projection and conv,
  decoder RMSNorms scaled by (1 + w); Qwen3.5's ``mtp.*`` module, where its weights are there,
  as ``model.mtp`` (unimax.mtp).
Both become one GDNForCausalLM whose mixer reads a merged [q, k, v, z, b, a] projection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .config import GDNConfig
from .demo import DEMO_NAME, check_demo_weights, demo_dir
from .model import GDNForCausalLM
from .tiny import TINY_NAME, build_tiny_random

log = logging.getLogger("unimax.checkpoint")
SUPPORTED_MODEL_TYPES = ("gated_deltanet", "qwen3_5_text", "qwen3_5")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
FP32_PARAMS = ("A_log", "dt_bias")  # gate parameters stay fp32: exp(A_log) is sensitive


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, key or tensor."""


# --- locating files ------------------------------------------------------------------------

def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """A local folder as is; ``tiny-random`` the built-in tiny model (written on first use);
    ``unimax-demo`` the shipped demo model; otherwise a hub repo id, fetched (config, weights,
    tokenizer)."""
    text = str(path_or_id)
    if text == TINY_NAME:
        return build_tiny_random()
    if text == DEMO_NAME:
        check_demo_weights()  # cheap (23 MB), and names a broken checkout before loading
        return demo_dir()
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{text} is a file; give the folder holding config.json")
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") != 1
    if looks_like_path:
        raise FileNotFoundError(f"model path {text} does not exist; give a folder with "
                                "config.json and *.safetensors, or a hub id like owner/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline, unknown repo, no permission: all end here
        raise FileNotFoundError(f"{text} is not a local folder and could not be fetched from "
                                f"the hub ({type(err).__name__}: {err}). Check the id, the "
                                "network, or download it and pass the folder") from err


def read_config_json(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds a JSON {type(config).__name__}, not the "
                              "object of a model's config: check the checkpoint's files")
    return config


@contextlib.contextmanager
def _open_weights(file: Path, device: torch.device | None = None):
    """safe_open with an error that names the file (a truncated download, a text file saved
    under a .safetensors name) instead of a bare SafetensorError."""
    try:
        handle = safe_open(file, framework="pt", device=str(device or "cpu"))
    except FileNotFoundError:
        raise CheckpointError(f"weights file {file} is missing (named in the checkpoint's "
                              "index): download the checkpoint again") from None
    except Exception as err:
        raise _unreadable(file, err) from None
    with handle:
        yield handle


def _unreadable(file: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"weights file {file} is not a readable safetensors file "
                           f"({type(err).__name__}: {err}); it may be truncated or corrupt: "
                           "download or export it again")


class WeightReader:
    """Tensor name -> safetensors file, over one file or a sharded index."""

    def __init__(self, model_dir: Path, device: torch.device):
        self.model_dir = model_dir
        self.device = device
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: model_dir / file for name, file in weight_map.items()}
        else:
            self.files = {}
            for file in sorted(model_dir.glob("*.safetensors")):
                with _open_weights(file) as handle:
                    self.files.update(dict.fromkeys(handle.keys(), file))
        if not self.files:
            bins = list(model_dir.glob("*.bin")) + list(model_dir.glob("*.pt"))
            hint = (" (found PyTorch .bin files: convert them to safetensors)" if bins else "")
            raise CheckpointError(f"no *.safetensors weights in {model_dir}{hint}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in "
                                  f"{self.model_dir}")
        file = self.files[name]
        with _open_weights(file, self.device) as handle:
            try:
                tensor = handle.get_tensor(name)
            except Exception as err:  # SafetensorError: a truncated or corrupt data section
                raise _unreadable(file, err) from None
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected "
                                  f"{tuple(shape)} from config.json")
        return tensor


# --- configs -------------------------------------------------------------------------------

def _require(raw: dict, key: str, where: str):
    if key not in raw:
        raise CheckpointError(f"config.json ({where}) lacks the key {key!r}")
    return raw[key]


def fla_config(raw: dict) -> GDNConfig:
    where = "gated_deltanet"
    unsupported = {
        "attn": (None, "hybrid attention layers (a later version adds them)"),
        "use_gate": (True, "models without the output gate"),
        "use_short_conv": (True, "models without the short convolution"),
        "attnres_block_size": (None, "attention residuals"),
    }
    for key, (wanted, what) in unsupported.items():
        if raw.get(key, wanted) != wanted:
            raise CheckpointError(f"config.json: {key}={raw[key]!r} is not supported "
                                  f"({what}); UNI MAX runs pure GDN models")
    if raw.get("hidden_act", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported; "
                              "only swish (SiLU) MLPs")
    hidden = _require(raw, "hidden_size", where)
    num_heads = _require(raw, "num_heads", where)
    head_dim = _require(raw, "head_dim", where)
    head_v_dim = head_dim * float(raw.get("expand_v", 2.0))
    if head_v_dim != int(head_v_dim):
        raise CheckpointError(f"config.json: head_dim * expand_v = {head_v_dim} is not an integer")
    intermediate = raw.get("intermediate_size")
    if intermediate is None:  # fla's GatedMLP rule: 2/3 * ratio * hidden, rounded up to 256
        intermediate = int(hidden * (raw.get("hidden_ratio") or 4) * 2 / 3)
        intermediate = 256 * ((intermediate + 255) // 256)
    gate_act = raw.get("output_gate_activation", "swish")
    return GDNConfig(
        vocab_size=_require(raw, "vocab_size", where), hidden_size=hidden,
        num_hidden_layers=_require(raw, "num_hidden_layers", where),
        num_k_heads=num_heads, num_v_heads=raw.get("num_v_heads") or num_heads,
        head_k_dim=head_dim, head_v_dim=int(head_v_dim), intermediate_size=intermediate,
        conv_size=raw.get("conv_size", 4), norm_eps=raw.get("norm_eps", 1e-6), norm_offset=0.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        gate_activation="sigmoid" if gate_act == "sigmoid" else "silu",
        allow_neg_eigval=bool(raw.get("allow_neg_eigval", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        max_position_embeddings=raw.get("max_position_embeddings"), source_layout="fla")


def qwen3_5_config(raw: dict, tie: bool) -> GDNConfig:
    where = "qwen3_5_text"
    layers = _require(raw, "num_hidden_layers", where)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        raise CheckpointError("config.json lacks layer_types; UNI MAX needs them to know the "
                              "layers are all linear_attention")
    if len(layer_types) != layers:
        raise CheckpointError(f"config.json: {len(layer_types)} layer_types for {layers} layers")
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"config.json: unknown layer type {unknown[0]!r}; supported: "
                              "linear_attention, full_attention")
    hybrid = "full_attention" in layer_types
    # the MTP module (unimax.mtp) is a gated-attention layer: its shape too, hybrid or not
    # (whether its weights are there is the loader's to find)
    mtp = int(raw.get("mtp_num_hidden_layers") or 0)
    if mtp > 1:
        log.warning("config.json: %d MTP layers; UNI MAX drafts with Qwen3.5's one MTP layer, "
                    "so this checkpoint loads without its MTP module", mtp)
        mtp = 0
    attention = {}
    if hybrid or mtp:
        if raw.get("attention_bias", False):
            raise CheckpointError("config.json: attention_bias=true is not supported")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"config.json: rope_type {rope['rope_type']!r} is not "
                                  "supported (only default)")
        heads = _require(raw, "num_attention_heads", where)
        attention = dict(
            layer_types=tuple(layer_types) if hybrid else None, num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            attn_head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 raw.get("partial_rotary_factor", 1.0))))
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"config.json: hidden_act={raw['hidden_act']!r} is not supported")
    return GDNConfig(
        vocab_size=_require(raw, "vocab_size", where),
        hidden_size=_require(raw, "hidden_size", where), num_hidden_layers=layers,
        num_k_heads=_require(raw, "linear_num_key_heads", where),
        num_v_heads=_require(raw, "linear_num_value_heads", where),
        head_k_dim=_require(raw, "linear_key_head_dim", where),
        head_v_dim=_require(raw, "linear_value_head_dim", where),
        intermediate_size=_require(raw, "intermediate_size", where),
        conv_size=raw.get("linear_conv_kernel_dim", 4), norm_eps=raw.get("rms_norm_eps", 1e-6),
        norm_offset=1.0, tie_word_embeddings=tie,
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        max_position_embeddings=raw.get("max_position_embeddings"), source_layout="qwen3_5",
        mtp_layers=mtp, **attention)


def parse_config(raw: dict) -> tuple[GDNConfig, str]:
    """GDNConfig and the tensor-name prefix of the text model."""
    model_type = raw.get("model_type")
    if model_type == "gated_deltanet":
        return fla_config(raw), "model."
    if model_type == "qwen3_5_text":
        return qwen3_5_config(raw, bool(raw.get("tie_word_embeddings", False))), "model."
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("config.json (qwen3_5) lacks text_config")
        tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return qwen3_5_config(text, tie), "model.language_model."
    raise CheckpointError(f"unknown model_type {model_type!r} in config.json; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")


# --- weights -------------------------------------------------------------------------------

def _layer_sources(cfg: GDNConfig, prefix: str, i: int) -> dict[str, list[tuple[str, tuple]]]:
    """Our parameter name -> the checkpoint tensors (name, shape) concatenated along dim 0."""
    hidden, kd, vd, hv = cfg.hidden_size, cfg.key_dim, cfg.value_dim, cfg.num_v_heads
    ours = f"layers.{i}."
    if cfg.source_layout == "fla":
        src = f"{prefix}layers.{i}."
        attn = src + "attn."
        return {
            ours + "mixer_norm.weight": [(src + "attn_norm.weight", (hidden,))],
            ours + "mixer.in_proj.weight": [
                (attn + "q_proj.weight", (kd, hidden)), (attn + "k_proj.weight", (kd, hidden)),
                (attn + "v_proj.weight", (vd, hidden)), (attn + "g_proj.weight", (vd, hidden)),
                (attn + "b_proj.weight", (hv, hidden)), (attn + "a_proj.weight", (hv, hidden))],
            ours + "mixer.conv_weight": [
                (attn + "q_conv1d.weight", (kd, 1, cfg.conv_size)),
                (attn + "k_conv1d.weight", (kd, 1, cfg.conv_size)),
                (attn + "v_conv1d.weight", (vd, 1, cfg.conv_size))],
            ours + "mixer.A_log": [(attn + "A_log", (hv,))],
            ours + "mixer.dt_bias": [(attn + "dt_bias", (hv,))],
            ours + "mixer.norm.weight": [(attn + "o_norm.weight", (cfg.head_v_dim,))],
            ours + "mixer.out_proj.weight": [(attn + "o_proj.weight", (hidden, vd))],
            ours + "mlp_norm.weight": [(src + "mlp_norm.weight", (hidden,))],
            **_mlp_sources(cfg, src + "mlp.", ours),
        }
    src = f"{prefix}layers.{i}."
    if cfg.is_attention(i):
        return _attention_sources(cfg, src, ours)
    attn = src + "linear_attn."
    return {
        ours + "mixer_norm.weight": [(src + "input_layernorm.weight", (hidden,))],
        ours + "mixer.in_proj.weight": [
            (attn + "in_proj_qkv.weight", (cfg.conv_dim, hidden)),
            (attn + "in_proj_z.weight", (vd, hidden)),
            (attn + "in_proj_b.weight", (hv, hidden)), (attn + "in_proj_a.weight", (hv, hidden))],
        ours + "mixer.conv_weight": [(attn + "conv1d.weight", (cfg.conv_dim, 1, cfg.conv_size))],
        ours + "mixer.A_log": [(attn + "A_log", (hv,))],
        ours + "mixer.dt_bias": [(attn + "dt_bias", (hv,))],
        ours + "mixer.norm.weight": [(attn + "norm.weight", (cfg.head_v_dim,))],
        ours + "mixer.out_proj.weight": [(attn + "out_proj.weight", (hidden, vd))],
        ours + "mlp_norm.weight": [(src + "post_attention_layernorm.weight", (hidden,))],
        **_mlp_sources(cfg, src + "mlp.", ours),
    }


def _attention_sources(cfg: GDNConfig, src: str, ours: str) -> dict[str, list[tuple[str, tuple]]]:
    """A Qwen3.5 gated-attention decoder layer (a hybrid's, or the MTP module's)."""
    hidden = cfg.hidden_size
    attn = src + "self_attn."
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attn_head_dim
    return {
        ours + "mixer_norm.weight": [(src + "input_layernorm.weight", (hidden,))],
        ours + "mixer.in_proj.weight": [
            (attn + "q_proj.weight", (2 * heads * dim, hidden)),
            (attn + "k_proj.weight", (kv * dim, hidden)),
            (attn + "v_proj.weight", (kv * dim, hidden))],
        ours + "mixer.q_norm.weight": [(attn + "q_norm.weight", (dim,))],
        ours + "mixer.k_norm.weight": [(attn + "k_norm.weight", (dim,))],
        ours + "mixer.o_proj.weight": [(attn + "o_proj.weight", (hidden, heads * dim))],
        ours + "mlp_norm.weight": [(src + "post_attention_layernorm.weight", (hidden,))],
        **_mlp_sources(cfg, src + "mlp.", ours),
    }


def mtp_sources(cfg: GDNConfig, src: str) -> dict[str, list[tuple[str, tuple]]]:
    """The MTP module's parameters (unimax.mtp) from Qwen3.5's ``mtp.*`` tensors under the
    prefix ``src``."""
    hidden = cfg.hidden_size
    sources = {f"mtp.{name}.weight": [(f"{src}{name}.weight", (hidden,))]
               for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    sources["mtp.fc.weight"] = [(src + "fc.weight", (hidden, 2 * hidden))]
    for i in range(cfg.mtp_layers):
        sources.update(_attention_sources(cfg, f"{src}layers.{i}.", f"mtp.layers.{i}."))
    return sources


def mtp_prefix(reader: WeightReader, prefix: str) -> str | None:
    """Where a checkpoint keeps its MTP tensors: top level (``mtp.``, Qwen3.5's releases),
    or under the text model's prefix; None where it has none (transformers' own saves drop
    them)."""
    for src in dict.fromkeys(("mtp.", f"{prefix}mtp.", "model.mtp.")):  # (in order, once)
        if f"{src}fc.weight" in reader:
            return src
    return None


def _mlp_sources(cfg: GDNConfig, src: str, ours: str) -> dict[str, list[tuple[str, tuple]]]:
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        ours + "mlp.gate_up_proj.weight": [(src + "gate_proj.weight", (inter, hidden)),
                                           (src + "up_proj.weight", (inter, hidden))],
        ours + "mlp.down_proj.weight": [(src + "down_proj.weight", (hidden, inter))],
    }


def weight_sources(cfg: GDNConfig, prefix: str) -> dict[str, list[tuple[str, tuple]]]:
    embed = "embeddings.weight" if cfg.source_layout == "fla" else "embed_tokens.weight"
    vocab_shape = (cfg.vocab_size, cfg.hidden_size)
    sources = {"embed_tokens.weight": [(prefix + embed, vocab_shape)],
               "norm.weight": [(prefix + "norm.weight", (cfg.hidden_size,))]}
    for i in range(cfg.num_hidden_layers):
        sources.update(_layer_sources(cfg, prefix, i))
    if not cfg.tie_word_embeddings:
        sources["lm_head.weight"] = [("lm_head.weight", vocab_shape)]
    return sources


def _parse_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)} or 'auto'")
    return names[dtype]


def _parse_device(device: torch.device | str | None) -> torch.device:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but CUDA is not available here; "
                           "use device='cpu'")
    return device


def load_model(path_or_id: str | os.PathLike, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None,
               max_context: int | None = None) -> GDNForCausalLM:
    """Build a GDNForCausalLM from a checkpoint folder or hub id, in eval mode.
    ``max_context`` sizes the attention layers' KV buffers of hybrid models (default 4096)."""
    device = _parse_device(device)
    dtype = _parse_dtype(dtype, device)
    model_dir = resolve_model_dir(path_or_id)
    cfg, prefix = parse_config(read_config_json(model_dir))
    if max_context is not None:
        cfg = dataclasses.replace(cfg, max_context=int(max_context))
    reader = WeightReader(model_dir, device)
    sources = weight_sources(cfg, prefix)
    if cfg.mtp_layers:
        src = mtp_prefix(reader, prefix)
        if src is None:  # (the config says so, the weights are not there: load as before)
            cfg = dataclasses.replace(cfg, mtp_layers=0)
        else:
            sources.update(mtp_sources(cfg, src))
    state = {}
    for name, pieces in sources.items():
        tensors = [reader.get(src, shape) for src, shape in pieces]
        tensor = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        if name.endswith("conv_weight"):
            tensor = tensor.squeeze(1)  # (D, 1, W) depthwise conv -> (D, W)
        wanted = torch.float32 if name.endswith(FP32_PARAMS) else dtype
        state[name] = tensor.to(wanted).contiguous()
    with torch.device("meta"):
        model = GDNForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:  # a bug in the adapters above, not in the user's checkpoint
        raise RuntimeError(f"adapter mismatch: missing {missing}, unexpected {unexpected}")
    model.name_or_path = str(path_or_id)
    return model.eval()


def load_tokenizer(path_or_id: str | os.PathLike):
    """The checkpoint's tokenizer (fast or sentencepiece) with its chat template."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(path_or_id)
    # Without a vocabulary file AutoTokenizer happily builds an empty tokenizer from config.json.
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"no usable tokenizer in {model_dir}: it needs one of "
                              f"{', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise CheckpointError(f"no usable tokenizer in {model_dir} ({type(err).__name__}: "
                              f"{err}); it needs tokenizer.json or tokenizer.model with "
                              "tokenizer_config.json") from err
