"""Kernel choices remembered: the per-shape choices (``ops.gemv.timed_choice``) come from a
table shipped per GPU architecture and from a cache on disk before anything is timed, and an
app that serves can leave the timing for later (``defer``), so that nothing is timed before the
first reply.

Why: each choice times every candidate form at every tile in captured graphs (ops.timing), and
a Qwen3.5-4B preset meets dozens of shapes; at start-up that was most of the minutes before
the first reply, and it was forgotten at exit.

- ``shipped/<arch>.json`` (in the package): the winners measured on that architecture at the
  presets' shapes (``bench/startup.py --dump-choices``). A card without one (sm_89, the L4)
  starts on each choice's default form.
- the disk cache, ``<cache folder>/choices/<machine>.json``, keyed by the card, its
  capability, torch, CUDA and Triton versions: what this machine timed. It wins over the
  shipped table.
- ``defer()`` (the app): a key known to neither takes its default at once, and its timing is
  kept for ``tune_pending`` (the app's background tuning, between replies once it serves),
  which writes the winners to the disk cache for the next start. The live process keeps the
  defaults its graphs were captured with.
Benches and tests time at first use as before (``deferred`` False).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SHIPPED = Path(__file__).resolve().parent / "shipped"


class ChoiceTable(dict):
    """One op's choices, ``key tuple -> kernel name``, with the name it is remembered by."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        TABLES[name] = self


TABLES: dict[str, ChoiceTable] = {}


@dataclass
class Pending:
    """A choice taken by default, its timing kept for later (``tune_pending``)."""

    table: ChoiceTable
    key: tuple
    time: object  # () -> the fastest name, timed now


_lock = threading.Lock()
_state = {"deferred": False, "machine": None, "known": None}
PENDING: list[Pending] = []
# what the remembered choices saved: keys answered from the shipped table and the disk cache
REMEMBERED = {"shipped": 0, "cache": 0, "deferred": 0, "tuned": 0}


def cache_folder() -> Path:
    """UNI MAX's cache folder (the tiny model, kernel choices, compile caches)."""
    return Path(os.environ.get("UNIMAX_CACHE", Path.home() / ".cache" / "unimax"))


def use_cache_folder(defer_choices: bool = True) -> Path:
    """The app's start: Triton's and inductor's compile caches, and Triton's autotuning
    results, under UNI MAX's cache folder (where none is set already), so that a restart
    compiles nothing it compiled before (inductor's default folder is in /tmp, gone after a
    reboot; Triton forgets its autotuning at exit unless asked), and kernel choices deferred
    (``defer``). The folder."""
    folder = cache_folder()
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    defer(defer_choices)
    return folder


def defer(on: bool = True) -> None:
    """Choices unknown to the shipped table and the disk cache take their default now and are
    timed later (``tune_pending``), not at first use."""
    _state["deferred"] = on


def deferred() -> bool:
    return _state["deferred"]


def machine() -> str:
    """What a timed choice depends on beyond the shape: the card and the software stack."""
    if _state["machine"] is None:
        if not torch.cuda.is_available():
            return "cpu"
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        _state["machine"] = (f"{props.name} sm_{props.major}{props.minor} torch "
                             f"{torch.__version__} cuda {torch.version.cuda} triton "
                             f"{triton_version}")
    return _state["machine"]


def arch() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _cache_file() -> Path:
    digest = hashlib.sha256(machine().encode()).hexdigest()[:16]
    return cache_folder() / "choices" / f"{digest}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("tables", {}) if isinstance(data, dict) else {}


def _known() -> dict:
    """{"shipped" | "cache": {table: {repr(key): repr(name)}}}, read once."""
    if _state["known"] is None:
        _state["known"] = {"shipped": _read(SHIPPED / f"{arch()}.json"),
                           "cache": _read(_cache_file())}
    return _state["known"]


def remembered(table: ChoiceTable, key: tuple, names: tuple[str, ...]) -> str | None:
    """The choice for ``key`` from the disk cache, else the shipped table; None if neither has
    it or it is no longer one of ``names`` (a kernel renamed or gone)."""
    with _lock:
        known = _known()
    for source in ("cache", "shipped"):
        text = known[source].get(table.name, {}).get(repr(key))
        if text is None:
            continue
        try:
            name = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
        if name in names:
            REMEMBERED[source] += 1
            return name
    return None


def keep_for_later(table: ChoiceTable, key: tuple, time) -> None:
    with _lock:
        if not any(p.table is table and p.key == key for p in PENDING):
            PENDING.append(Pending(table, key, time))
            REMEMBERED["deferred"] += 1


def remember(entries: list[tuple[ChoiceTable, tuple, str]]) -> None:
    """Write choices to the disk cache (atomically: a second process may be reading it)."""
    if not entries:
        return
    with _lock:
        path = _cache_file()
        tables = _read(path)
        for table, key, name in entries:
            tables.setdefault(table.name, {})[repr(key)] = repr(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"machine": machine(), "tables": tables}, indent=1,
                                  sort_keys=True))
        tmp.replace(path)
        if _state["known"] is not None:
            _state["known"]["cache"] = tables


def tune_pending(limit: int | None = None) -> int:
    """Time up to ``limit`` deferred choices (all by default) and remember the winners on disk
    for the next start; how many were timed. The live tables keep their defaults: the graphs
    captured with them stay as they are."""
    done = []
    while limit is None or len(done) < limit:
        with _lock:
            if not PENDING:
                break
            pending = PENDING.pop(0)
        done.append((pending.table, pending.key, pending.time()))
    remember(done)
    REMEMBERED["tuned"] += len(done)
    return len(done)


def snapshot() -> dict:
    """Every table's choices so far, as the shipped tables and the disk cache store them."""
    return {name: {repr(key): repr(value) for key, value in table.items()}
            for name, table in sorted(TABLES.items()) if table}


def forget_known() -> None:
    """Read the shipped table and the disk cache again at the next lookup (tests)."""
    _state["known"] = None
    _state["machine"] = None
