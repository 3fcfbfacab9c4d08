"""Presets: one YAML file says which model to load and how to serve it; validated on load."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

MODES = ("bf16", "fp8", "verified")


class PresetError(ValueError):
    """A preset key or value that cannot be used; the message names it and what is allowed."""


@dataclass(frozen=True)
class GenerationDefaults:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               "generation.max_new_tokens", self.max_new_tokens, "an integer >= 1")
        _check(_number(self.temperature) and self.temperature >= 0, "generation.temperature",
               self.temperature, "a number >= 0 (0 = greedy)")
        _check(_number(self.top_p) and 0 < self.top_p <= 1, "generation.top_p", self.top_p,
               "a number in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "generation.top_k", self.top_k,
               "an integer >= 0 (0 = off)")
        _check(self.seed is None or isinstance(self.seed, int), "generation.seed", self.seed,
               "an integer or null")


@dataclass(frozen=True)
class Preset:
    model: str = "tiny-random"  # folder, hub id, or a built-in: tiny-random, unimax-demo
    dtype: str = "auto"
    device: str = "auto"
    mode: str = "fp8"
    block_size: int = 8
    draft: str = "tail"  # verified mode's draft: tail (state-safe) or full (every linear FP8)
    compile_step: bool = False
    max_context: int = 4096  # the longest conversation (prompt + reply) in tokens
    state_memory_mib: int = 1024  # kept conversation states on the GPU; beyond it, host memory
    host_state_memory_mib: int = 8192  # beyond this, the oldest kept states are dropped
    system_prompt: str = ""
    enable_thinking: bool | None = None  # chat templates with a thinking switch (Qwen3.5)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    name: str = "custom"

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model.strip() != "", "model", self.model,
               "a checkpoint folder, a hub id, tiny-random or unimax-demo")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype", self.dtype,
               "auto, bfloat16, float16, float32")
        _check(self.device in ("auto", "cuda", "cpu") or str(self.device).startswith("cuda:"),
               "device", self.device, "auto, cuda, cuda:N, cpu")
        _check(self.mode in MODES, "mode", self.mode, ", ".join(MODES))
        _check(isinstance(self.block_size, int) and 1 <= self.block_size <= 64, "block_size",
               self.block_size, "an integer in 1..64")
        _check(self.draft in ("tail", "full"), "draft", self.draft, "tail, full")
        _check(isinstance(self.compile_step, bool), "compile_step", self.compile_step,
               "true or false")
        for key in ("max_context", "state_memory_mib", "host_state_memory_mib"):
            value = getattr(self, key)
            _check(isinstance(value, int) and value >= 1, key, value, "an integer >= 1")
        _check(isinstance(self.system_prompt, str), "system_prompt", self.system_prompt,
               "a string")
        _check(self.enable_thinking in (None, True, False), "enable_thinking",
               self.enable_thinking, "true, false or null (the template's default)")

    def to_dict(self) -> dict:
        return asdict(self)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
    gen_keys = {f.name for f in fields(GenerationDefaults)}
    unknown = sorted(set(generation) - gen_keys)
    if unknown:
        raise PresetError(f"unknown preset key 'generation.{unknown[0]}'; allowed: "
                          f"{', '.join(sorted(gen_keys))}")
    if raw.get("model") is not None:
        raw["model"] = str(raw["model"])
    return Preset(**raw, generation=GenerationDefaults(**generation), name=name)


def load_preset(path: str | Path) -> Preset:
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"preset file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise PresetError(f"preset file {path} is not valid YAML: {err}") from err
    return preset_from_dict(raw, name=path.stem)
