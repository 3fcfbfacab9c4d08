"""Presence, frequency and repetition penalties, as OpenAI's API and vLLM define them, applied to
the logits before the choice (and before the temperature), in every mode.

- ``repetition`` (vLLM's and transformers' repetition_penalty; 1 = off): every token in the
  prompt or the reply so far has its logit divided by it where positive, multiplied where not;
- ``frequency`` (OpenAI's frequency_penalty; 0 = off): minus it times the token's count in the
  reply so far;
- ``presence`` (OpenAI's presence_penalty; 0 = off): minus it once for a token in the reply so
  far.

A penalized reply decodes through the engines' held path (unimax.held: one token per step in
fast mode; in verified mode blocks of drafts checked against a per-position table), the path a
reply held to a grammar takes: the choice needs the counts up to the token before it, which the
block graphs do not carry. ``Penalties`` is that path's device state: the counts of the reply's
accepted tokens, those after each draft of a verify block (one row per position, as the
grammar's mask table), the prompt's tokens and the three settings as device tensors, so one
captured graph serves every reply (neutral settings leave the logits exactly as they were).
``penalize_reference`` is the plain twin the tests hold it to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PenaltySettings:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
             settings: torch.Tensor) -> torch.Tensor:
    """``logits`` (R, V) penalized, as float32: ``counts`` (R, V) the reply's token counts
    before each row's token, ``in_prompt`` (V,) bool, ``settings`` (3,) float32: presence,
    frequency, repetition. Graph-safe; neutral settings return the logits unchanged."""
    x = logits.float()
    present = counts > 0
    repetition = settings[2]
    x = torch.where(present | in_prompt, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - settings[1] * counts - settings[0] * present.float()


def penalize_reference(logits: torch.Tensor, reply: list[int], prompt: list[int],
                       settings: PenaltySettings) -> torch.Tensor:
    """The plain definition for one position (float64): ``logits`` (V,), the reply's tokens
    before it, the prompt's."""
    out = logits.double().clone()
    counts = Counter(reply)
    for token in set(reply) | set(prompt):
        value = float(out[token])
        out[token] = value / settings.repetition if value > 0 else value * settings.repetition
    for token, count in counts.items():
        out[token] -= settings.frequency * count + settings.presence
    return out


class Penalties:
    """The held path's penalty state on the device (see the module's docstring). The engine
    calls ``start`` at a reply's first held token, ``add`` with the tokens each step or block
    emitted, and ``row`` before each draft of a verify block and before its check; the
    graphs read ``now`` (the next token's counts) and ``table`` (a block's rows)."""

    def __init__(self, vocab_size: int, device: torch.device, rows: int = 1):
        self.device = device
        self.base = torch.zeros(1, vocab_size, device=device)  # the accepted tokens' counts
        self.now = torch.zeros(1, vocab_size, device=device)
        self.table = torch.zeros(rows, vocab_size, device=device)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.settings = torch.tensor([0.0, 0.0, 1.0], device=device)
        self.active = False
        # a block's tokens reach the device without a host sync: through a pinned buffer, the
        # copy queued (the next add comes after the host has read a later token, so the copy
        # before it is done)
        cuda = torch.device(device).type == "cuda"
        self.host_ids = torch.zeros(rows + 1, dtype=torch.long, pin_memory=cuda)
        self.ids = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self.ones = torch.ones(rows + 1, device=device)

    def start(self, settings: PenaltySettings | None, prompt: list[int]) -> None:
        """A new held reply: ``settings`` (None or neutral: the graphs leave logits alone)
        and its prompt's tokens (the repetition penalty's)."""
        was, self.active = self.active, settings is not None and settings.active
        if not self.active:
            if was:  # (stale counts are harmless under neutral settings)
                self.settings.copy_(torch.tensor([0.0, 0.0, 1.0]))
            return
        self.settings.copy_(torch.tensor([settings.presence, settings.frequency,
                                          settings.repetition]))
        for tensor in (self.base, self.now, self.table):
            tensor.zero_()
        self.in_prompt.zero_()
        if prompt:
            self.in_prompt[torch.tensor(prompt, device=self.device)] = True

    def add(self, tokens: list[int]) -> None:
        """Tokens the reply emitted: counted, and the next token's counts are the reply's."""
        if not (self.active and tokens):
            return
        n = len(tokens)
        if n > len(self.host_ids):  # (more than a block: a plain, synchronous copy)
            ids = torch.tensor(tokens, device=self.device)
            self.base[0].index_add_(0, ids, torch.ones(n, device=self.device))
        else:
            self.host_ids[:n] = torch.tensor(tokens, dtype=torch.long)
            self.ids[:n].copy_(self.host_ids[:n], non_blocking=True)
            self.base[0].index_add_(0, self.ids[:n], self.ones[:n])
        self.now.copy_(self.base)

    def row(self, i: int, draft: int | None = None) -> None:
        """A verify block's row i: the counts after its first i drafts (``draft``: the i-th,
        just chosen; i = 0 starts from the reply's)."""
        if not self.active:
            return
        if i == 0:
            self.now.copy_(self.base)
        else:
            self.now[0, draft] += 1
        self.table[i].copy_(self.now[0])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token's logits (1, V) penalized (graph-safe)."""
        return penalize(logits, self.now, self.in_prompt, self.settings)

    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """A block's logits (R, V), row i penalized by the table's row i (graph-safe)."""
        return penalize(logits, self.table[:logits.shape[0]], self.in_prompt, self.settings)
