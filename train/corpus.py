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
# The names people use, not the modules that define them: os.path.join is posixpath.join,
# os.getcwd posix.getcwd, len builtins.len (the demo model answered "What does os.getcwd do?"
# with another function's docstring: the corpus only had posix.getcwd).
ALIASES = (("builtins.", ""), ("posixpath.", "os.path."), ("genericpath.", "os.path."),
           ("posix.", "os."))
# Names people ask about first: always in the training split, and the demo model's evaluation
# (tests/models/test_demo.py: its first sentence must be the documentation's for >= 80% of them).
COMMON_NAMES = (
    "os.path.join", "os.getcwd", "os.listdir", "os.path.exists", "os.path.basename",
    "os.path.dirname", "os.mkdir", "os.remove", "os.rename", "os.path.splitext",
    "len", "print", "open", "sorted", "isinstance", "enumerate", "zip", "str.split", "str.join",
    "str.replace", "str.strip", "list.append", "list.sort", "dict.get", "dict.items",
    "json.dumps", "json.loads", "json.load", "json.dump", "re.sub", "re.match", "re.search",
    "re.findall", "re.compile", "math.sqrt", "math.floor", "random.randint", "random.choice",
    "random.shuffle", "time.sleep", "time.time", "shutil.copy", "shutil.rmtree",
    "subprocess.run", "glob.glob", "itertools.chain", "functools.partial", "copy.deepcopy",
    "sys.exit", "csv.reader")
# A paragraph that is only a call's signature ("sleep(seconds)", "D.items() -> a set-like
# object ..."): the answer is the paragraph after it.
SIGNATURE = re.compile(r"^[\w.]+\(.*\)( -+> .*)?$")
SIGNATURE_SENTENCE = re.compile(r"^[\w.]+\(.*?\) -+> ([A-Z].*)$")


def first_paragraph(doc: str, limit: int = 600) -> str:
    paragraphs = [p for p in inspect.cleandoc(doc).split("\n\n") if p.strip()] or [""]
    while len(paragraphs) > 1 and SIGNATURE.match(paragraphs[0].strip()) and \
            not paragraphs[1].lstrip().startswith(">>>"):
        paragraphs = paragraphs[1:]
    text = re.sub(r"\s+", " ", paragraphs[0]).strip()
    described = SIGNATURE_SENTENCE.match(text)  # "zip(...) --> Yield tuples until ..."
    if described:
        text = described.group(1)
    if len(text) > limit:
        cut = text[:limit].rsplit(". ", 1)[0]
        text = cut + "." if len(cut) > 40 else text[:limit].rstrip() + "..."
    return text


def signature(obj) -> str | None:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError, NameError, AttributeError):  # (a C default it cannot read)
        return None


def members(module):
    """(qualified name, object) for the module's public functions, classes and methods."""
    # (a module's C accelerator defines some of its names: csv.reader is _csv's; a module's
    # functions may be a hidden instance's bound methods: random.randint)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) not in (
                module.__name__, "_" + module.__name__):
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and (inspect.isfunction(member) or
                                                 inspect.ismethoddescriptor(member)):
                    yield f"{module.__name__}.{name}.{attr}", member


def common_name(name: str) -> str:
    """The name a user would ask about (ALIASES)."""
    if name == "io.open":  # the builtin open
        return "open"
    for prefix, alias in ALIASES:
        if name.startswith(prefix):
            return alias + name[len(prefix):]
    return name


def resolve(name: str):
    """The object a name as people write it names: "os.path.join", "len", "str.split"."""
    import builtins

    parts = name.split(".")
    obj, rest = builtins, parts
    for cut in range(len(parts), 0, -1):
        try:
            obj, rest = importlib.import_module(".".join(parts[:cut])), parts[cut:]
            break
        except ImportError:
            continue
    for part in rest:
        obj = getattr(obj, part)
    return obj


def documented_answer(name: str) -> str:
    """The corpus's answer to "What does NAME do?" on this Python."""
    return first_paragraph(inspect.getdoc(resolve(name)))


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]


def split_of(key: str) -> str:
    if key in COMMON_NAMES:
        return "train"
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
            name = common_name(name)
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
