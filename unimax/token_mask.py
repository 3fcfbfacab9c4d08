"""A grammar's allowed tokens as a bitmask on the device, applied to logits inside the engines'
captured graphs: a reply held to a grammar (unimax.structured) decodes through the same graphs
as any other reply of its mode, one token per replay.

The bitmask is xgrammar's layout: int32 words, bit ``t % 32`` of word ``t // 32`` set where
token t is allowed. The host fills a pinned copy from the grammar's matcher before each step and
queues its copy to the device; the graph reads the device copy, so one captured graph serves
every step and every grammar. Unpacking it is a gather and a shift, plain torch with fixed
shapes (graph-safe, no compiler for the card); its naive twin is xgrammar's own
``apply_token_bitmask_inplace`` (tests/engine/test_token_mask.py).
"""

from __future__ import annotations

import torch

from .penalties import Penalties

ALL = -1  # every bit set: every token allowed (a thinking block before the held answer)


class TokenMask:
    """The next token's mask (``bits``, for a one-token choice), and with ``rows`` > 1 a table
    of masks, one per position of a verify block held to a grammar (``table``: row i the mask
    after the block's first i drafts)."""

    def __init__(self, vocab_size: int, device: torch.device, rows: int = 1):
        words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size
        self.host = torch.full((rows, words), ALL, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.bits = torch.full((1, words), ALL, dtype=torch.int32, device=device)
        self.table = torch.full((rows, words), ALL, dtype=torch.int32, device=device)
        index = torch.arange(vocab_size, device=device)
        self.word = index // 32
        self.shift = (index % 32).to(torch.int32)
        # a penalized reply's counts, applied before the mask (neutral otherwise: the same
        # logits, as float32)
        self.penalties = Penalties(vocab_size, device, rows)

    def load(self, constraint, row: int | None = None) -> None:
        """The next token's mask from ``constraint`` (structured.Constraint; None: every
        token), queued to the device (``row``: to that row of the table as well). The graph
        that reads it must follow on the same stream; the host refills a row only after that
        graph's result came back, so the pinned copy is never overwritten early."""
        at = 0 if row is None else row
        host = self.host[at:at + 1]
        if constraint is None:  # (after a stop id a finished grammar has no next mask)
            host.fill_(ALL)
        else:
            constraint.fill(host)
        self.bits.copy_(host, non_blocking=True)
        if row is not None:
            self.table[row:row + 1].copy_(host, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1, vocab_size), penalized (``penalties``), with every token the mask
        forbids at -inf (a new float32 tensor; graph-safe)."""
        allowed = (self.bits[0, self.word] >> self.shift) & 1
        return self.penalties.apply(logits).masked_fill(allowed == 0, float("-inf"))

    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (R, vocab_size), row i penalized and masked by the tables' row i
        (graph-safe)."""
        allowed = (self.table[:logits.shape[0], self.word] >> self.shift) & 1
        return self.penalties.apply_rows(logits).masked_fill(allowed == 0, float("-inf"))


class NoGrammar:
    """The constraint of a held reply with no grammar (a penalized one: unimax.penalties):
    every token allowed, nothing to feed or take back. structured.Constraint's interface."""

    active = True

    def fill(self, out: torch.Tensor) -> None:
        out.fill_(ALL)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def accept(self, token: int) -> None:
        pass

    def rollback(self, count: int) -> None:
        pass
