"""The shipped demo model (issue: a demo model that actually talks): its files match the
training record, it loads offline in a fresh process, and through the app's service it answers a
held-out question (one the training split never saw) in words, not fragments."""

import functools
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from helpers import ROOT
from unimax.demo import DEMO_DIR, check_demo_weights
from unimax.export import weights_sha256

# Questions from the corpus's held-out split (train/corpus.py: split_of), never trained on.
HELD_OUT = ["What does cmath.asin do?", "Explain integers in Python.",
            "What does bytes.decode do?"]

CHILD = """
import json, sys
from unimax.presets import load_preset
from unimax.service import EngineService
service = EngineService(load_preset("presets/demo.yaml")).start()
replies = []
for i, question in enumerate(json.loads(sys.argv[1])):
    handle = service.submit(f"c{i}", [{"role": "user", "content": question}])
    events = list(handle.events(timeout=300))
    assert events[-1].kind == "done", [(e.kind, e.text) for e in events]
    replies.append(events[-1].data["reply"])
service.stop()
print(json.dumps(replies))
"""


@functools.cache
def english_vocabulary() -> set[str]:
    """Every word written in the standard library's sources and the documentation topics that
    ship with Python (docstrings and comments are English prose): ~40k words, offline."""
    from pydoc_data.topics import topics

    texts = list(topics.values())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib.rglob("*.py"):
        if "site-packages" not in path.parts and "test" not in path.parts:
            texts.append(path.read_text(errors="ignore"))
    return {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}


def known_word_share(text: str, vocabulary: set[str]) -> tuple[float, int]:
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w.lower() in vocabulary for w in words) / max(len(words), 1), len(words)


def test_weights_match_the_training_record(tmp_path):
    record = json.loads((DEMO_DIR / "train_record.json").read_text())
    assert check_demo_weights() == record["model_sha256"] == weights_sha256(DEMO_DIR)
    size = sum(f.stat().st_size for f in DEMO_DIR.iterdir())
    assert size <= 25e6, size
    broken = tmp_path / "demo"
    shutil.copytree(DEMO_DIR, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match its training record"):
        check_demo_weights(broken)


def run_child(questions, env_extra=None) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT / ".pytest-home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(questions)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_demo_answers_held_out_questions_in_words_offline():
    replies = run_child(HELD_OUT)
    vocabulary = english_vocabulary()
    for question, reply in zip(HELD_OUT, replies, strict=True):
        share, count = known_word_share(reply, vocabulary)
        assert count >= 5 and share >= 0.8, (question, reply, share)


def test_the_word_check_fails_on_noise():
    """The check can fail: tiny-random's reply (random weights) is not words."""
    import torch

    import unimax

    model, tok = unimax.load_model("tiny-random"), unimax.load_tokenizer("tiny-random")
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": HELD_OUT[0]}],
                                                add_generation_prompt=True, return_dict=False)])
    reply = tok.decode(unimax.exact_greedy_tokens(model, ids, 80)[0].tolist())
    share, count = known_word_share(reply, english_vocabulary())
    assert share < 0.5 or count < 5, reply


def test_demo_knows_the_names_people_ask_about():
    """"What does os.getcwd do?" got another function's docstring: the corpus named it
    posix.getcwd (os.path.join posixpath.join, len builtins.len). The fifty names people ask
    about first (train/corpus.py: COMMON_NAMES): the reply's first sentence is the
    documentation's for at least 80% of them (the shipped weights: bench/RESULTS.md)."""
    from train.corpus import COMMON_NAMES, documented_answer, first_sentence
    from unimax.presets import load_preset
    from unimax.service import EngineService, GenerationSettings

    service = EngineService(load_preset(ROOT / "presets" / "demo.yaml")).start()
    wrong = []
    try:
        for name in COMMON_NAMES:
            handle = service.submit(f"eval-{name}", [
                {"role": "user", "content": f"What does {name} do?"}], "bf16",
                GenerationSettings(max_new_tokens=64))
            reply = list(handle.events(timeout=120))[-1].data["reply"]
            expected = first_sentence(documented_answer(name))
            if not reply.strip().startswith(expected):
                wrong.append((name, reply[:80]))
    finally:
        service.stop()
    rate = 1 - len(wrong) / len(COMMON_NAMES)
    print(f"demo model: {rate:.0%} of {len(COMMON_NAMES)} common names answered right", wrong)
    assert len(COMMON_NAMES) == 50 and rate >= 0.8, (rate, wrong)
