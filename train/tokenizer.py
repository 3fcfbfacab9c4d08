"""A small sentencepiece BPE tokenizer trained on the corpus, saved so that transformers'
AutoTokenizer loads it (tokenizer.model + tokenizer_config.json), with a ChatML template.

usage: python -m train.tokenizer CORPUS.jsonl OUT_DIR [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from .corpus import read_corpus

SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def render(messages: list[dict]) -> str:
    """The chat template's text for a conversation (the training text)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def train_tokenizer(corpus: str | Path, out_dir: str | Path, vocab_size: int = 4096) -> Path:
    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [render(e["messages"]) for e in read_corpus(corpus) if e["split"] == "train"]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text("\n".join(t.replace("\n", " ") for t in train))
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(Path(tmp) / "spm"), vocab_size=vocab_size,
            model_type="bpe", character_coverage=1.0, byte_fallback=True,
            user_defined_symbols=SPECIAL, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            split_digits=True, num_threads=1, minloglevel=2,
            max_sentence_length=20000)
        shutil.copy(Path(tmp) / "spm.model", out_dir / "tokenizer.model")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": False,
        "add_eos_token": False, "additional_special_tokens": SPECIAL,
        "chat_template": CHAT_TEMPLATE, "legacy": False}, indent=1))
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    print(train_tokenizer(args.corpus, args.out_dir, args.vocab))
