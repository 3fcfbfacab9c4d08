"""Verified mode's draft from the model's own MTP module (unimax.mtp): ``draft="mtp"``.

The MTP module predicts the token two ahead of a hidden state, so a draft of k tokens is one MTP
step per token instead of a step of a quantized copy of the whole model. Its KV must hold one
entry per position the exact model has kept, each computed from the exact model's hidden state
there and the token that followed it:

- after the prompt (``prefill``): the pairs (h_p, x_{p+1}) of every prompt position, the last
  one with the first reply token; its output at the last row is the first draft;
- after every verifier block (``catch_up``, inside the verifier's graph, after its rewind):
  the block's rows (h of each input, the exact model's token after it: for the accepted rows
  exactly the tokens kept) at the positions the block fed, of which the first ``count`` count
  (m + 1 for a block of m accepted drafts, n for an exact run of n steps); the position is
  then set past them, so the rows after (rejected drafts) are never read, and the output at
  the last counted row is the next block's first draft;
- ``run_block(k)``: the other k - 1 drafts, each MTP step fed its own last hidden state and
  the token it predicted.

Everything stays on the device (the count and positions are device scalars), so the catch-up
runs inside the verifier's captured graphs. Its drafts are only drafts: the verifier checks
every one, so what the MTP's KV holds (a stale entry, another conversation's) can only cost
acceptance, never exactness.

Greedy drafts only for now: a sampled verified reply, or one held to a grammar, on an MTP
engine takes exact steps (the engine).
"""

from __future__ import annotations

import torch


class MTPDraft:
    """The MTP drafter of one engine: the MTP module's KV (its own cache and position), the
    rows the verifier leaves it, and the drafted tokens (``out_tokens``, where the verifier
    reads them)."""

    def __init__(self, model, block_size: int):
        if getattr(model, "mtp", None) is None:
            raise ValueError("draft 'mtp' needs a checkpoint with Qwen3.5's MTP weights "
                             "(mtp.*); this model has none: use draft 'full' (the FP8 draft)")
        self.model = model
        self.mtp = model.mtp
        self.block_size = block_size
        self.cache = model.mtp.make_cache()
        device, dtype = model.device, model.dtype
        rows, hidden = block_size + 1, model.config.hidden_size
        long = dict(dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, rows, hidden, dtype=dtype, device=device)  # h of each row
        self.tokens = torch.zeros(1, rows, **long)  # the exact model's token after each row
        self.count = torch.ones((), **long)  # the rows that count
        self.last = torch.zeros(1, 1, hidden, dtype=dtype, device=device)  # the MTP's last h
        self.out_tokens = torch.zeros(1, block_size, **long)

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The MTP over (hidden, the embeddings of tokens) at its cache's position (which
        advances by the rows): its normed outputs."""
        return self.mtp.forward_unchecked(hidden, self.model.embed_tokens(tokens), self.cache)

    def _first(self, out: torch.Tensor) -> None:
        """``out``'s row at count - 1 is the next block's first draft's hidden state."""
        self.last.copy_(out.index_select(1, (self.count - 1)[None]))
        self.out_tokens[:, :1].copy_(self.model.lm_head(self.last)[:, 0].argmax(dim=-1,
                                                                               keepdim=True))

    @torch.inference_mode()
    def prefill(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int) -> None:
        """A prompt's rows (its positions from ``start``: their normed hidden states and the
        tokens after them, the last the first reply token), in chunks of the prompt's, eager;
        the last row's output is the first draft."""
        tokens = hidden.shape[1]
        self.cache.position.fill_(start)
        self.cache.seen_tokens = start
        with self.cache.attending(start + tokens, exact=True):
            out = self._step(hidden, next_tokens)
        self.cache.seen_tokens = start + tokens
        self.count.fill_(tokens)
        self._first(out)

    def catch_up(self, rows: int, start: torch.Tensor) -> None:
        """The verifier's block or run just left ``rows`` rows in ``hidden`` and ``tokens``
        and ``count`` set, from position ``start`` (a device scalar: no host sync): the MTP's
        KV over them, its position past the counted ones, and the next first draft."""
        self.cache.position.copy_(start)
        out = self._step(self.hidden[:, :rows], self.tokens[:, :rows])
        self.cache.position.copy_(start + self.count)
        self._first(out)

    def run_block(self, k: int, record: bool = False) -> None:
        """The drafts 2..k after the first (``out_tokens[:, :k]``), each MTP step fed its last
        hidden state and the token it drafted."""
        if record:
            raise ValueError("MTP drafts are greedy only: no draft distributions to record")
        for j in range(1, k):
            out = self._step(self.last, self.out_tokens[:, j - 1:j])
            self.last.copy_(out)
            self.out_tokens[:, j:j + 1].copy_(self.model.lm_head(out)[:, 0].argmax(
                dim=-1, keepdim=True))
