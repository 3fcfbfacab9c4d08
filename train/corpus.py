"""A chat corpus built from the Python standard library's own docstrings (PSF License 2.0, see
train/DATA_LICENSE.md): "What does json.dumps do?" -> the documented answer, "How do I call
...?" -> the signature, "What is the ... module for?" -> the module's summary. Deterministic for
a given Python version; the training run records the corpus hash.

usage: python -m train.corpus OUT.jsonl   (a fresh process: torch and friends patch some stdlib
objects, e.g. inspect.getfile, which changes their entries)
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "test",
        "pydoc_data", "ensurepip", "venv", "distutils", "msilib", "winreg", "winsound",
        "_winapi", "msvcrt", "nt", "__main__", "__phello__", "__hello__"}
# Every importable public standard-library module (the list depends on the Python version).
MODULES = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in SKIP)
HELD_OUT_ONE_IN = 20  # names whose hash falls here go to the held-out split


def first_paragraph(doc: str, limit: int = 600) -> str:
    text = inspect.cleandoc(doc).split("\n\n")[0]
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) > limit:
        cut = text[:limit].rsplit(". ", 1)[0]
        text = cut + "." if len(cut) > 40 else text[:limit].rstrip() + "..."
    return text


def signature(obj) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def members(module):
    """(qualified name, object) for the module's public functions, classes and methods."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) not in (
                module.__name__, module.__name__.replace("os.path", "posixpath")):
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and (inspect.isfunction(member) or
                                                 inspect.ismethoddescriptor(member)):
                    yield f"{module.__name__}.{name}.{attr}", member


def split_of(key: str) -> str:
    digest = int(hashlib.sha1(key.encode()).hexdigest(), 16)
    return "heldout" if digest % HELD_OUT_ONE_IN == 0 else "train"


def topic_examples():
    """The language reference's topics that ship with Python (pydoc_data): all of their prose,
    as multi-turn conversations ("Explain ..." then "Go on."), so the demo also learns to carry
    a conversation past its first answer."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name, text in sorted(topics.items()):
        paragraphs = [re.sub(r"\s+", " ", p).strip() for p in text.split("\n\n")]
        paragraphs = [p for p in paragraphs if len(p) > 60 and not p.startswith(("*", ">>>"))]
        if not paragraphs:
            continue
        yield _chat(f"Explain {name} in Python.", first_paragraph(paragraphs[0]), "topic:" + name)
        parts = list(_pieces(paragraphs, 1200))
        for start in range(0, len(parts), 3):
            opener = "Tell me about" if start == 0 else "Tell me more about"
            questions = [f"{opener} {name} in Python."] + ["Go on."] * 2
            turns = list(zip(questions, parts[start:start + 3], strict=False))
            yield _conversation(turns, "topic:" + name)


def _pieces(paragraphs: list[str], limit: int):
    """Consecutive paragraphs joined into pieces of at most ~limit characters."""
    piece = ""
    for p in paragraphs:
        if piece and len(piece) + len(p) > limit:
            yield piece
            piece = ""
        piece = f"{piece} {p}".strip() if len(p) <= limit else first_paragraph(p, limit)
    if piece:
        yield piece


def examples():
    """Chat examples: {"messages": [...], "split": "train" | "heldout", "key": name}."""
    yield from topic_examples()
    warnings.simplefilter("ignore")
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # platform-specific or broken modules: skip
            continue
        if module.__doc__:
            answer = first_paragraph(module.__doc__)
            yield _chat(f"What is the {module_name} module for?", answer, module_name)
        for name, obj in members(module):
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 20:
                continue
            answer = first_paragraph(doc)
            yield _chat(f"What does {name} do?", answer, name)
            longer = re.sub(r"[ \t]+", " ", doc)[:2400].strip()
            if len(longer) > len(answer) + 80:
                yield _chat(f"Tell me more about {name}.", longer, name)
            sig = signature(obj)
            # Defaults whose repr holds a memory address would make the corpus differ per run.
            if sig is not None and len(sig) < 160 and " at 0x" not in sig:
                short = answer.split(". ")[0].rstrip(".") + "."
                yield _chat(f"How do I call {name}?", f"Call it as {name}{sig}. {short}", name)


def _chat(question: str, answer: str, key: str) -> dict:
    return _conversation([(question, answer)], key)


def _conversation(turns: list[tuple[str, str]], key: str) -> dict:
    messages = [{"role": role, "content": text} for q, a in turns
                for role, text in (("user", q), ("assistant", a))]
    return {"messages": messages, "split": split_of(key), "key": key}


def write_corpus(path: str | Path) -> dict:
    path = Path(path)
    lines = [json.dumps(e, ensure_ascii=False) for e in examples()]
    path.write_text("\n".join(lines) + "\n")
    held = sum('"split": "heldout"' in line for line in lines)
    return {"examples": len(lines), "heldout": held, "python": sys.version.split()[0],
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def read_corpus(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    print(json.dumps(write_corpus(sys.argv[1]), indent=1))
