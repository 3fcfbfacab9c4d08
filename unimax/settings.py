"""Generation settings: one class, validated once, for every caller (presets, the page, the
Python API, HTTP). A bad value raises SettingsError naming the field and what is allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RequestError
from .penalties import PenaltySettings
from .sampling import SamplingParams

MAX_SEED = 2**63 - 1  # torch.Generator takes a signed 64-bit seed
# A temperature divides float32 logits: past ~3.4e38 it is infinite there, and long before
# that every token is as likely as any other (at 100 the demo model's are within 2%).
MAX_TEMPERATURE = 100.0
# Below this a temperature is greedy decoding: logits / 1e-38 overflow to inf and sampled
# random tokens. vLLM's threshold (its _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # any vocabulary is smaller; a device tensor holds it
MAX_PENALTY = 2.0  # presence and frequency: OpenAI's range is -2..2
MAX_REPETITION = 10.0  # repetition_penalty: > 0 (vLLM's rule), 1 = off; past 10 is no use


class SettingsError(RequestError):
    """A generation setting that cannot be used; ``field`` names it."""

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"{field} has the value {value!r}; allowed: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def is_int(value) -> bool:
    """An integer that is not a bool (YAML's and JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    thinking: bool | None = None  # the chat template's thinking switch; None: the preset's
    min_p: float = 0.0  # 0 = off; else keep tokens at least min_p times the likeliest's chance
    # (unimax.penalties; a penalized reply decodes one token per step, or verified blocks
    # checked per position: see there)
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             "an integer >= 1"),
            ("temperature", is_number(self.temperature)
             and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"a number in 0..{MAX_TEMPERATURE:g} (0 = greedy)"),
            ("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
             f"an integer in 0..{MAX_TOP_K} (0 = off)"),
            ("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1,
             "a number in [0, 1] (0 = off)"),
            ("seed", self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"empty, or an integer in 0..{MAX_SEED}"),
            ("thinking", self.thinking in (None, True, False), "true, false or empty"),
            ("presence_penalty", is_number(self.presence_penalty)
             and abs(self.presence_penalty) <= MAX_PENALTY,
             f"a number in -{MAX_PENALTY:g}..{MAX_PENALTY:g} (0 = off)"),
            ("frequency_penalty", is_number(self.frequency_penalty)
             and abs(self.frequency_penalty) <= MAX_PENALTY,
             f"a number in -{MAX_PENALTY:g}..{MAX_PENALTY:g} (0 = off)"),
            ("repetition_penalty", is_number(self.repetition_penalty)
             and 0 < self.repetition_penalty <= MAX_REPETITION,
             f"a number in (0, {MAX_REPETITION:g}] (1 = off)"),
        )
        for field, ok, allowed in checks:
            if not ok:
                raise SettingsError(field, getattr(self, field), allowed)

    def sampling(self) -> SamplingParams:
        temperature = float(self.temperature)
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        return SamplingParams(temperature, self.top_k, float(self.top_p), self.seed,
                              float(self.min_p))

    def penalties(self) -> PenaltySettings:
        return PenaltySettings(float(self.presence_penalty), float(self.frequency_penalty),
                               float(self.repetition_penalty))
