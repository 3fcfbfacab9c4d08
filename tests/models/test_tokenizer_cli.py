"""Tokenizers load through AutoTokenizer (fast and sentencepiece), and the CLI runs end to end."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import unimax
from helpers import ROOT, rel_err, write_qwen_checkpoint
from unimax import CheckpointError

CORPUS = ["the quick brown fox jumps over the lazy dog",
          "recurrent models keep a fixed size state", "hello world, this is gated delta"] * 40
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_fast_tokenizer(path, vocab_size=90):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:40])
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def write_sentencepiece_tokenizer(path, vocab_size=60):
    import sentencepiece as spm

    path.mkdir(parents=True, exist_ok=True)
    corpus = path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(path / "spm"),
                                   vocab_size=vocab_size, model_type="bpe", bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, minloglevel=2)
    shutil.move(path / "spm.model", path / "tokenizer.model")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "chat_template": TEMPLATE}))


def test_fast_tokenizer_with_chat_template(tmp_path):
    write_fast_tokenizer(tmp_path)
    tok = unimax.load_tokenizer(tmp_path)
    assert tok.decode(tok("the lazy dog").input_ids) == "the lazy dog"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|user|>hi\n<|assistant|>"


def test_sentencepiece_tokenizer(tmp_path):
    write_sentencepiece_tokenizer(tmp_path)
    tok = unimax.load_tokenizer(tmp_path)
    assert len(tok) == 60
    ids = tok("the quick brown fox").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "the quick brown fox"


def test_folder_without_tokenizer(tmp_path):
    write_qwen_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no usable tokenizer"):
        unimax.load_tokenizer(tmp_path)


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "unimax", *args], capture_output=True, env=env,
                          timeout=300)
    # Decoded here, not with text=True: text mode turns a generated "\r" into "\n", and a
    # random model does generate one now and then.
    proc.stdout, proc.stderr = (b.decode("utf-8", "replace") for b in (proc.stdout, proc.stderr))
    return proc


def test_cli_generate(tmp_path):
    write_qwen_checkpoint(tmp_path, vocab=97)
    write_fast_tokenizer(tmp_path, vocab_size=90)
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "the quick brown",
                   "--max-new-tokens", "12", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "12 new tokens" in proc.stderr and "tok/s" in proc.stderr
    model = unimax.load_model(tmp_path)
    tok = unimax.load_tokenizer(tmp_path)
    expected = unimax.exact_greedy_tokens(model, torch.tensor([tok("the quick brown").input_ids]),
                                          12)
    assert proc.stdout.strip() == tok.decode(expected[0].tolist(), skip_special_tokens=True).strip()
    chat = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--chat",
                   "--max-new-tokens", "3")
    assert chat.returncode == 0, chat.stderr


def test_cli_engine_modes(tmp_path):
    """--mode runs the app's engines: bf16 and verified print the exact greedy continuation
    (the CPU has no near ties between paths here: float32, the same kernels), verified with its
    acceptance; fp8 runs its FP8 tail."""
    write_qwen_checkpoint(tmp_path, vocab=97)
    write_fast_tokenizer(tmp_path, vocab_size=90)
    model = unimax.load_model(tmp_path)
    tok = unimax.load_tokenizer(tmp_path)
    expected = unimax.exact_greedy_tokens(model, torch.tensor([tok("the quick brown").input_ids]),
                                          20)
    text = tok.decode(expected[0].tolist(), skip_special_tokens=True).strip()
    for mode in ("bf16", "verified", "fp8"):
        proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "the quick brown",
                       "--max-new-tokens", "20", "--ignore-eos", "--mode", mode)
        assert proc.returncode == 0, proc.stderr
        assert "20 new tokens: decode" in proc.stderr and f"tok/s; {mode}" in proc.stderr
        if mode != "fp8":
            assert proc.stdout.strip() == text, mode
        if mode == "verified":
            assert re.search(r"\(full draft\): acceptance [01]\.\d+, \d+ drafted, \d+ "
                             r"accepted", proc.stderr), proc.stderr
    verified = run_cli("generate", "--model", str(tmp_path), "--prompt", "the quick brown",
                       "--max-new-tokens", "20", "--ignore-eos", "--mode", "verified",
                       "--draft", "int4")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.strip() == text
    assert re.search(r"\(int4 draft\): acceptance [01]\.\d+, \d+ drafted, \d+ accepted",
                     verified.stderr), verified.stderr
    one = run_cli("generate", "--model", str(tmp_path), "--prompt", "the quick brown",
                  "--max-new-tokens", "1", "--mode", "verified")
    assert one.returncode == 0 and "(full draft): nothing drafted" in one.stderr, one.stderr
    assert one.stdout.strip() == tok.decode(expected[0, :1].tolist(),
                                            skip_special_tokens=True).strip()


def test_cli_bad_input(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "   ")
    assert proc.returncode == 2 and "--prompt is empty" in proc.stderr
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "x", "--draft", "full")
    assert proc.returncode == 2 and "--draft is verified mode's draft" in proc.stderr


def test_builtin_tiny_random_is_a_real_qwen_checkpoint(tmp_path, monkeypatch):
    """The built-in model is written in the Qwen3.5 layout: transformers itself loads it and
    computes the same logits, and its tokenizer round-trips any text."""
    from transformers import Qwen3_5ForCausalLM

    monkeypatch.setenv("UNIMAX_CACHE", str(tmp_path))
    model = unimax.load_model("tiny-random", device="cpu", dtype="float32")
    path = next(tmp_path.iterdir())
    reference = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    tok = unimax.load_tokenizer("tiny-random")
    text = "Grüße, world! 1+1=2"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    x = torch.tensor([ids])
    with torch.no_grad():
        assert rel_err(model(input_ids=x).logits,
                       reference(input_ids=x, use_cache=False).logits) < 1e-4
    assert model.config.eos_token_id == tok.eos_token_id
    proc = run_cli("generate", "--model", "tiny-random", "--prompt", "Hello", "--chat",
                   "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kind", ["sentencepiece", "tiny"])
def test_incremental_detokenizer_matches_full_decode(tmp_path, kind):
    from unimax.detokenize import IncrementalDetokenizer

    if kind == "sentencepiece":
        write_sentencepiece_tokenizer(tmp_path)
        tok = unimax.load_tokenizer(tmp_path)
        text = "the quick brown fox jumps over the lazy dog hello world"
    else:
        tok = unimax.load_tokenizer("tiny-random")
        text = "Grüße aus Köln, 東京 and emoji too 🙂"
    ids = tok(text, add_special_tokens=False).input_ids
    for step in (1, 3, 8):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
        assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in p for p in pieces)
    # a reply cut inside a multi-byte character: held back while streaming, flushed at the end
    cut = ids[:-1] if kind == "tiny" else ids
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in cut) + detok.flush()
    assert streamed == tok.decode(cut, skip_special_tokens=True)
