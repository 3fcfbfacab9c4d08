"""The built-in demo model, ``unimax-demo``: a small pure-GDN chat model trained by train/train.py
on the Python standard library's documentation and shipped in the repo (models/unimax-demo,
Qwen3.5 text layout, BF16 safetensors in two shards, sentencepiece tokenizer). Its
train_record.json holds the weights' sha256 as the training run wrote them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .export import weights_sha256

DEMO_NAME = "unimax-demo"
DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / DEMO_NAME


def demo_dir() -> Path:
    if not (DEMO_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the demo model is not at {DEMO_DIR}: it ships with the UNI MAX "
                                "repository (models/unimax-demo); use a full checkout, or pick "
                                "another preset / --model")
    return DEMO_DIR


def check_demo_weights(path: Path | None = None) -> str:
    """The weights' sha256, after checking it against the training record (a partial or altered
    checkout, e.g. Git LFS pointers instead of files, fails here with a clear message). Hashed
    once per state of the files: loading the model and its tokenizer both resolve the name."""
    path = path or demo_dir()
    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                  for f in sorted(path.glob("*.safetensors")))
    return _checked_sha256(path, files)


@functools.cache
def _checked_sha256(path: Path, files: tuple) -> str:
    recorded = json.loads((path / "train_record.json").read_text())["model_sha256"]
    actual = weights_sha256(path)
    if actual != recorded:
        raise ValueError(f"the demo model's weights in {path} do not match its training record "
                         f"(sha256 {actual[:12]}… vs {recorded[:12]}…): restore the files from "
                         "the repository")
    return actual
