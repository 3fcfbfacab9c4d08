"""A built-in tiny random model, ``tiny-random``: a real checkpoint folder (Qwen3.5 text layout,
safetensors, config.json, byte-level tokenizer with a chat template) written locally with no
download. It proves the plumbing end to end on any machine; its text is noise.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import GDNConfig
from .export import save_checkpoint
from .model import GDNForCausalLM
from .ops.choices import cache_folder

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
    return cache_folder() / f"{TINY_NAME}-v{TINY_VERSION}"


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
    save_checkpoint(model, tmp, eos_token_id=256 + 2,
                    unimax_note="tiny random model built locally by unimax.tiny; its text is "
                                "noise")
    if not (path / "config.json").is_file():
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return path
