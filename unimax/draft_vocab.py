"""A full draft whose LM head scores part of the vocabulary only (verified mode's draft).

A ~4B GDN model's LM head is its largest linear: 248k rows of 2560, 636 MB in FP8, ~15% of a
full-FP8 draft step's bytes (bench/shapes.py). A draft only proposes tokens that the exact
model then checks, so its head need not score every token: scoring N of them reads N rows.
Tokens outside the subset are never drafted: where the exact model picks one, that block is
rejected at it and the exact model emits it as the block's bonus token, so the output is exact
greedy decoding either way; only acceptance can drop, by how often replies use tokens outside
the subset. Which ids: the caller's (``ranked_ids``: the most frequent in text like the app's),
or an int N for ids 0..N-1, for speed benches (random weights) only: on the trained demo
model the first ids covered far fewer reply tokens than the most frequent (bench/RESULTS.md,
twenty-first session). FR-Spec (Zhao et al., ACL 2025) does this for an EAGLE draft's head,
with a frequency-ranked quarter of a 128k vocabulary. For verified sampling the draft's
distribution is zero outside the subset, which the speculative rule handles like any other
draft distribution.

The head keeps the full vocabulary's logit layout (-inf outside the subset), so the decoder,
its sampling and the verifier are unchanged; the subset's rows are quantized as the full head's
are (per row), so its logits there are exactly the full FP8 head's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .fp8 import FP8Linear


def subset_ids(vocab_size: int, choice: int | Sequence[int]) -> torch.Tensor:
    """The head's token ids: ``choice`` an int N (ids 0..N-1) or the ids themselves (distinct,
    in range); sorted."""
    if isinstance(choice, bool):
        raise TypeError("draft_vocab must be a number of tokens or a list of token ids, "
                        f"got {choice!r}")
    if isinstance(choice, int):
        if not 1 <= choice <= vocab_size:
            raise ValueError(f"draft_vocab must be 1..{vocab_size} tokens (the vocabulary), "
                             f"got {choice}")
        return torch.arange(choice)
    ids = torch.as_tensor(list(choice), dtype=torch.long)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("draft_vocab's ids must be a non-empty list of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft_vocab's ids must lie in 0..{vocab_size - 1}; got "
                         f"{int(ids.min())}..{int(ids.max())}")
    if ids.unique().numel() != ids.numel():
        raise ValueError("draft_vocab's ids must be distinct")
    return ids.sort().values


def ranked_ids(sequences, size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` ids a draft head should score, from token-id ``sequences`` (text like the
    replies it will draft, tokenized): ``always`` first (stop ids: a reply's last block would
    otherwise be rejected at its stop token), then the most frequent ids (ties: the lower id),
    then, if the text has fewer distinct ids, the lowest unused ids. Sorted."""
    always = list(dict.fromkeys(int(i) for i in always))
    if len(always) > size:
        raise ValueError(f"draft_vocab: {len(always)} ids must always be in it, more than its "
                         f"size {size}")
    counts: dict[int, int] = {}
    for sequence in sequences:
        for token in sequence:
            counts[int(token)] = counts.get(int(token), 0) + 1
    chosen = dict.fromkeys(always)
    for token in sorted(counts, key=lambda t: (-counts[t], t)):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    token = 0
    while len(chosen) < size:
        chosen.setdefault(token)
        token += 1
    return sorted(chosen)


class SubsetHead(nn.Module):
    """An LM head over ``ids`` only, in FP8: logits of the full vocabulary's size, -inf
    outside ``ids``."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor, mode: str | None = None):
        super().__init__()
        weight = head.weight.detach()
        ids = ids.to(weight.device)
        rows = nn.Linear(head.in_features, len(ids), bias=False, device=weight.device,
                         dtype=weight.dtype)
        with torch.no_grad():
            rows.weight.copy_(weight.index_select(0, ids))
        self.rows = FP8Linear(rows, mode=mode)
        self.register_buffer("ids", ids)
        self.in_features, self.out_features = head.in_features, head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.rows(x)
        logits = scores.new_full((*scores.shape[:-1], self.out_features), float("-inf"))
        return logits.index_copy(-1, self.ids, scores)
