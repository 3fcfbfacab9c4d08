"""A grammar's allowed tokens as a bitmask on the device, applied to logits inside the engines'
captured graphs: a reply held to a grammar (unimax.structured) decodes through the same graphs
as any other reply of its mode, one token per replay.

The bitmask is xgrammar's layout: int32 words, bit ``t % 32`` of word ``t // 32`` set where
token t is allowed. The host fills a pinned copy from the grammar's matcher before each step and
queues its copy to the device; the graph reads the device copy, so one captured graph serves
every step and every grammar. Unpacking it is a gather and a shift, plain torch with fixed
shapes (graph-safe, no compiler for the card); its naive twin is xgrammar's own
``apply_token_bitmask_inplace`` (tests/test_token_mask.py).
"""

from __future__ import annotations

import torch

ALL = -1  # every bit set: every token allowed (a thinking block before the held answer)


class TokenMask:
    def __init__(self, vocab_size: int, device: torch.device):
        words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size
        self.host = torch.full((1, words), ALL, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.bits = torch.full((1, words), ALL, dtype=torch.int32, device=device)
        index = torch.arange(vocab_size, device=device)
        self.word = index // 32
        self.shift = (index % 32).to(torch.int32)

    def load(self, constraint) -> None:
        """The next token's mask from ``constraint`` (structured.Constraint), queued to the
        device. The step that reads it must follow on the same stream; the host refills only
        after that step's token came back, so the pinned copy is never overwritten early."""
        constraint.fill(self.host)
        self.bits.copy_(self.host, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (..., vocab_size) with every token the mask forbids at -inf (a new
        tensor; graph-safe)."""
        allowed = (self.bits[0, self.word] >> self.shift) & 1
        return logits.masked_fill(allowed == 0, float("-inf"))
