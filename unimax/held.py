"""A reply held to a grammar, one token per step, with the host's turn behind the GPU's work.

Every token of a held reply passes through the host: xgrammar's matcher takes it and only then
fills the mask of the token after it (unimax.structured, unimax.token_mask). Run as one graph
per token, that turn (the token's trip to the host, the matcher, the mask's fill and copy, the
next launch) leaves the GPU idle: at the Qwen3.5-0.8B shape on an H100 a held token took 1.495
ms against a plain one's 1.073 (bench/RESULTS.md). But only the choice
needs the mask, not the forward before it. So each step is two graphs: the forward (feed the
last token, its logits to a static buffer) and the choice (the mask, then argmax or a draw).
The engine queues choice(t), then forward(t + 1) right behind it, which reads token t on the
device, and only then waits for token t (an event after its copy to pinned memory, not for the
forward queued after it): the matcher and the next mask's fill run while the GPU runs the next
forward.

The forward after the last token is not wasted in verified mode: the engine's finish feeds
every emitted token, the last one too, to the exact cache, and this is that feed. (In fast mode
the decoder's cache is dropped after a reply: the engine skips the forward after a reply's last
token by count; after a stop id it costs one step.)

Verified mode's held replies draft through the draft decoder's held steps, each draft
masked by the grammar after the drafts before it, and verify each block against those masks
(engine._held_verified_loop); sampled ones too, each draft's masked distribution recorded and
each block checked by the speculative rule on the masked exact distributions. Drafting
costs a host sync per draft, which nothing hides: at the Qwen3.5-0.8B shape on an H100 drafted
held replies ran 802 tok/s against 977 for exact steps. So the draft-length
policy prices it (``HostTurns``, learned from the reply's blocks), and where drafts do not pay the
reply takes exact runs of held steps, pipelined as above, between probes.

The naive twin of a held reply is a full forward per token without a cache, its logits masked
alike (tests/engine/test_token_mask.py); this file holds what the decoder and the verifier share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from_logits, sample_with_probs


def choose(logits: torch.Tensor, decoder, uniform: torch.Tensor, sampled: bool,
           probs: torch.Tensor | None = None) -> torch.Tensor:
    """The held step's token (1, 1) from ``logits`` (1, vocab): the grammar's mask
    (``decoder.token_mask``) applied, then argmax, or a draw with the decoder's sampling
    settings and ``uniform`` (1,); ``probs`` (1, vocab; sampled): the distribution drawn from
    is written there (a draft of verified sampling under a grammar). Graph-safe."""
    logits = decoder.token_mask.apply(logits)
    if sampled and probs is not None:
        token, drawn_from = sample_with_probs(logits, decoder.temperature, decoder.top_k,
                                              decoder.top_p, uniform, decoder.min_p)
        probs.copy_(drawn_from)
        return token
    if sampled:
        return sample_from_logits(logits, decoder.temperature, decoder.top_k, decoder.top_p,
                                  uniform, decoder.min_p)
    return logits.argmax(dim=-1, keepdim=True)


class TokenToHost:
    """A chosen token's copy to pinned host memory, and its arrival as an event: ``receive``
    waits for the choice only, not for the forward the engine queued after it."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.long, pin_memory=cuda)
        self.ready = torch.cuda.Event() if cuda else None

    def send(self, token: torch.Tensor) -> None:
        self.host.copy_(token.reshape(1), non_blocking=True)
        if self.ready is not None:
            self.ready.record()

    def receive(self) -> int:
        if self.ready is not None:
            self.ready.synchronize()
        return int(self.host[0])


def logits_buffer(logits: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """The static buffer a held forward writes its logits (1, vocab) to: ``held``, or a new
    one on the first (eager) run. A graph's warm-ups run before its capture, so the buffer
    exists before any capture and the graph writes the same memory every replay."""
    if held is None or held.shape != logits.shape or held.dtype != logits.dtype:
        held = torch.empty_like(logits)
    return held


@dataclass
class HostTurns:
    """The host time a held reply's verified blocks add to their graphs' (the draft-length
    policy's costs are the graphs' replay times, unimax.draft_length): per draft (its sync,
    the matcher, the next mask's fill, the final mask's row, the masked check's extra work),
    and per exact step (what the queued forward does not hide). Each is a running mean of the
    blocks measured, ``weight`` for the newest; both start at 0 (the plain reply's costs: a
    held reply drafts from its first block, as a plain one does, and learns from it). Kept by
    the engine across replies. ``learn`` False keeps them as set (tests)."""

    draft_ms: float = 0.0
    step_ms: float = 0.0
    weight: float = 0.25
    learn: bool = True

    def __call__(self, k: int) -> float:
        """The host ms a block of k drafts adds (k = 0: one exact step)."""
        return k * self.draft_ms if k else self.step_ms

    def observe(self, k: int, count: int, wall_ms: float, graphs_ms: float) -> None:
        """A block of k drafts (k = 0: an exact run of ``count`` steps; else count = k) took
        ``wall_ms`` from its first launch to its tokens on the host, its graphs ``graphs_ms``
        of that."""
        if not self.learn or count < 1:
            return
        each = max(0.0, (wall_ms - graphs_ms) / count)
        if k:
            self.draft_ms += self.weight * (each - self.draft_ms)
        else:
            self.step_ms += self.weight * (each - self.step_ms)
