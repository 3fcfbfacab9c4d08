"""Choosing the next token on the device: greedy, or sampled with temperature / top-k / top-p /
min-p (in that order, as transformers' warpers apply them: min-p keeps the tokens at least
``min_p`` times as likely as the most likely one).

Sampling reads its randomness from a uniform number the caller supplies (drawn from a seeded
generator outside any graph), so a captured graph and an eager run draw the same tokens, and a
seed reproduces a reply. Top-k, top-p and min-p are device tensors, so one captured graph serves
every setting. ``sample_reference`` is the plain twin the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _warp_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p, min-p over logits (N, V): the kept probabilities in
    descending order (not renormalized; zeros for filtered tokens) and the order (token ids).
    ``min_p`` None: off (no kernel for it)."""
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
    if min_p is not None:  # against the most likely token, which every filter keeps
        probs = probs.masked_fill(probs < min_p * probs[..., :1], 0.0)
    return probs, order


def _draw_sorted(probs: torch.Tensor, order: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)
    return order.gather(-1, index)


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, uniform: torch.Tensor,
                       min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits (1, V); temperature, top_p, min_p (1,) float; top_k (1,) long (0 = off);
    uniform (1,) in [0, 1). Returns the token (1, 1). No host sync, fixed shapes: graph-safe."""
    return _draw_sorted(*_warp_sorted(logits, temperature, top_k, top_p, min_p), uniform)


def warped_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution ``sample_from_logits`` draws from, in token order: (N, V) -> (N, V)."""
    return _in_token_order(*_warp_sorted(logits, temperature, top_k, top_p, min_p))


def _in_token_order(probs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Sorted kept probabilities back in token order, renormalized."""
    return torch.zeros_like(probs).scatter_(-1, order, probs / probs.sum(-1, keepdim=True))


def sample_with_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, uniform: torch.Tensor,
                      min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_from_logits`` (the same token for the same uniform) and the ``warped_probs`` it
    drew from, with one sort: what a draft of verified sampling records."""
    probs, order = _warp_sorted(logits, temperature, top_k, top_p, min_p)
    return _draw_sorted(probs, order, uniform), _in_token_order(probs, order)


def _kept_reference(logits: torch.Tensor, params: SamplingParams
                    ) -> tuple[list[int], torch.Tensor]:
    """The tokens the warps keep, most likely first, and the tempered probabilities."""
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
    top = float(probs[kept[0]])
    return [i for i in kept if float(probs[i]) >= params.min_p * top], probs


def warped_probs_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The plain definition of the distribution ``sample_reference`` draws from (float64)."""
    kept, probs = _kept_reference(logits, params)
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample_reference(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """The plain definition, one token: filter, renormalize, invert the CDF at ``uniform``."""
    kept, probs = _kept_reference(logits, params)
    weights = [float(probs[i]) for i in kept]
    threshold, running = uniform * sum(weights), 0.0
    for i, w in zip(kept, weights, strict=True):
        running += w
        if threshold < running:
            return i
    return kept[-1]
