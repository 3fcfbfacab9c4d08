"""Presets: one YAML file says which model to load and how to serve it; validated on load."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from .modes import DRAFTS, MODES
from .settings import GenerationSettings, SettingsError, is_int

MIN_CONTEXT, MAX_CONTEXT = 64, 1 << 20
MAX_EXAMPLES = 8  # the page shows them as a grid over the empty chat


class PresetError(ValueError):
    """A preset key or value that cannot be used; the message names it and what is allowed."""


@dataclass(frozen=True)
class Preset:
    model: str = "tiny-random"  # folder, hub id, or a built-in: tiny-random, unimax-demo
    dtype: str = "auto"
    device: str = "auto"
    mode: str = "fp8"
    block_size: int = 8
    draft: str = "tail"  # verified mode's draft: tail (state-safe), full (every linear FP8)
    # or int4 (the body in 4 bits, the head FP8; opt-in: modes.DRAFTS)
    compile_step: bool | str = "auto"  # the fast step: auto = on where CUDA and Triton run
    max_context: int = 4096  # the longest conversation (prompt + reply) in tokens
    prefill_chunk: int = 16384  # prompt tokens per prefill forward (engine.PREFILL_CHUNK)
    state_memory_mib: int = 1024  # kept conversation states on the GPU; beyond it, host memory
    host_state_memory_mib: int = 8192  # beyond this, the oldest kept states are dropped
    system_prompt: str = ""
    enable_thinking: bool | None = None  # chat templates with a thinking switch (Qwen3.5)
    # first messages the page offers on an empty chat (one click sends one): what this model
    # answers well, so a new user's first question is not a guess
    examples: tuple[str, ...] = ()
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    name: str = "custom"

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model.strip() != "", "model", self.model,
               "a checkpoint folder, a hub id, tiny-random or unimax-demo")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype", self.dtype,
               "auto, bfloat16, float16, float32")
        _check(self.device in ("auto", "cuda", "cpu") or str(self.device).startswith("cuda:"),
               "device", self.device, "auto, cuda, cuda:N, cpu")
        _check(self.mode in MODES, "mode", self.mode, ", ".join(MODES))
        _check(is_int(self.block_size) and 1 <= self.block_size <= 64, "block_size",
               self.block_size, "an integer in 1..64")
        _check(self.draft in DRAFTS, "draft", self.draft, ", ".join(DRAFTS))
        _check(self.compile_step in (True, False, "auto"), "compile_step", self.compile_step,
               "auto (on where CUDA and Triton run), true or false")
        # A chat turn needs room for the template, a message and a reply; the page's slider of
        # new tokens runs from 1 to max_context.
        _check(is_int(self.max_context) and MIN_CONTEXT <= self.max_context <= MAX_CONTEXT,
               "max_context", self.max_context,
               f"an integer in {MIN_CONTEXT}..{MAX_CONTEXT} (tokens)")
        _check(is_int(self.prefill_chunk) and 1 <= self.prefill_chunk <= MAX_CONTEXT,
               "prefill_chunk", self.prefill_chunk, f"an integer in 1..{MAX_CONTEXT} (tokens)")
        for key in ("state_memory_mib", "host_state_memory_mib"):
            value = getattr(self, key)
            _check(is_int(value) and value >= 1, key, value, "an integer >= 1 (MiB)")
        _check(isinstance(self.system_prompt, str), "system_prompt", self.system_prompt,
               "a string")
        _check(self.enable_thinking in (None, True, False), "enable_thinking",
               self.enable_thinking, "true, false or null (the template's default)")
        _check(isinstance(self.examples, tuple) and len(self.examples) <= MAX_EXAMPLES
               and all(isinstance(e, str) and e.strip() for e in self.examples), "examples",
               self.examples, f"a list of at most {MAX_EXAMPLES} non-empty messages")

    def to_dict(self) -> dict:
        return asdict(self)


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise PresetError(f"preset key {key!r} has the value {value!r}; allowed: {allowed}")


def preset_from_dict(raw: dict, name: str = "custom") -> Preset:
    if not isinstance(raw, dict):
        raise PresetError("a preset is a YAML mapping of keys to values")
    keys = {f.name for f in fields(Preset)} - {"name"}
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise PresetError(f"unknown preset key {unknown[0]!r}; allowed keys: "
                          f"{', '.join(sorted(keys))}")
    raw = dict(raw)
    generation = raw.pop("generation", None) or {}
    if not isinstance(generation, dict):
        raise PresetError("preset key 'generation' must be a mapping")
    gen_keys = {f.name for f in fields(GenerationSettings)} - {"thinking"}  # enable_thinking
    unknown = sorted(set(generation) - gen_keys)
    if unknown:
        raise PresetError(f"unknown preset key 'generation.{unknown[0]}'; allowed: "
                          f"{', '.join(sorted(gen_keys))}")
    if raw.get("model") is not None:
        raw["model"] = str(raw["model"])
    if isinstance(raw.get("examples"), list | type(None)):  # YAML's list (or an empty key);
        raw["examples"] = tuple(raw.get("examples") or ())  # the frozen preset keeps a tuple
    try:
        settings = GenerationSettings(**generation)
    except SettingsError as err:
        _check(False, f"generation.{err.field}", err.value, err.allowed)
    return Preset(**raw, generation=settings, name=name)


def load_preset(path: str | Path) -> Preset:
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"preset file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise PresetError(f"preset file {path} is not UTF-8 text ({err}); save it as UTF-8"
                          ) from err
    except yaml.YAMLError as err:
        raise PresetError(f"preset file {path} is not valid YAML: {err}") from err
    return preset_from_dict(raw, name=path.stem)
