"""Choosing the next token on the device: greedy, or sampled with temperature / top-k / top-p.

Sampling reads its randomness from a uniform number the caller supplies (drawn from a seeded
generator outside any graph), so a captured graph and an eager run draw the same tokens, and a
seed reproduces a reply. Top-k and top-p are device tensors, so one captured graph serves every
setting. ``sample_reference`` is the plain twin the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """logits (1, V); temperature, top_p (1,) float; top_k (1,) long (0 = off); uniform (1,)
    in [0, 1). Returns the token (1, 1). No host sync, fixed shapes: graph-safe."""
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1)
    return order.gather(-1, index)


def sample_reference(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """The plain definition, one token: filter, renormalize, invert the CDF at ``uniform``."""
    probs = torch.softmax(logits.double().flatten() / params.temperature, dim=0)
    ranked = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    if params.top_k:
        ranked = ranked[: params.top_k]
    kept, mass = [], 0.0
    total = sum(float(probs[i]) for i in ranked)
    for i in ranked:
        if kept and mass >= params.top_p * total:
            break
        kept.append(i)
        mass += float(probs[i])
    weights = [float(probs[i]) for i in kept]
    threshold, running = uniform * sum(weights), 0.0
    for i, w in zip(kept, weights, strict=True):
        running += w
        if threshold < running:
            return i
    return kept[-1]
