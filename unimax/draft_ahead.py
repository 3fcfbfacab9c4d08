"""Draft-ahead verified blocks: the next block's drafts are made while this block is checked.

A verified block is k draft steps and then one exact check, one after the other; both read
weights, and neither keeps the memory system busy alone (a kernel's launch, ramp and tail: on
the H200 a GEMV costs ~2.5 us beyond its bytes, bench/RESULTS.md). Here the check of block i
runs on the main stream while, on a second stream, the draft goes on from where its drafts for
block i ended: it feeds its own k-th draft and drafts k + 1 more tokens, a guess at block i's
bonus token and then the drafts of block i + 1. The two share no buffer: the check reads its
drafts from ``Verifier.drafts`` and the exact caches, the draft writes its own cache and the
decoder's ``out_tokens``; the check's graph leaves the draft's cache alone (the plain loop
resyncs it from the exact cache inside each check).

Block i + 1 then checks the drafts made ahead if block i accepted all k drafts and its bonus
token (the exact model's) equals the guess: they are exactly the drafts the plain loop would
have drafted had its draft state not been resynced (the draft's state was never put back to
the exact one; its drift only changes what is drafted, never what is emitted). Otherwise they
are dropped: the draft's cache is resynced from the exact one and the next block drafts anew
before its check, as the plain loop does. Every block is still checked by the exact model over
[its first token, its drafts], so the output is exact greedy decoding either way.

Pure GDN models only: on a hybrid the draft and the check share the attention KV buffers (the
draft would write KV the concurrent check reads and writes). Greedy only, a fixed draft length
(``draft_block``); off CUDA the two "streams" are the one, in order, and the semantics the same.
``UniMaxEngine.draft_ahead`` turns it on (off by default until measured on a GPU:
bench/verified.py --ahead).
"""

from __future__ import annotations

import contextlib

import torch


def usable(engine, k: int | None, sampled: bool) -> bool:
    """Whether a reply's verified blocks can run drafts ahead: greedy, a fixed k, pure GDN."""
    return (engine.draft_ahead and k is not None and not sampled
            and not engine.exact_cache.has_attention)


class SideStream:
    """The second stream the drafts run ahead on (CUDA), or nothing (elsewhere: in order)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    def __call__(self):
        """A with-block on the side stream, after what the main stream has queued so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)


def ahead_blocks(engine, n: int, k: int, counts, plain_blocks):
    """Yields the tokens each block emits, as ``UniMaxEngine._verified_blocks`` does, for up to
    ``n`` tokens in blocks of k drafts with the next block's drafts made during each check.
    The last blocks (fewer than 2 (k + 1) tokens left: no full block after them to draft
    for) go to ``plain_blocks(n, k, counts)``, the plain loop."""
    graph, verifier = engine.decode_graph, engine.verifier
    side = engine.side_stream()
    guesses = torch.zeros(1, k + 1, dtype=torch.long, device=engine.device)
    remaining = n
    drafted = False  # whether verifier.drafts holds the next block's drafts
    synced = True  # whether the draft's cache is the exact one's (the bridge after prefill)
    while remaining >= 2 * (k + 1):
        if not drafted:  # as the plain loop: from the exact state, after the next first token
            if not synced:
                verifier.resync_draft()
            graph.static_token.copy_(verifier.current)
            verifier.drafts[:, :k].copy_(graph.run_block(k))
        with side():  # feeds the k-th draft, then drafts k + 1: the guess, the next drafts
            guesses[:, :k].copy_(graph.run_block(k))
            guesses[:, k:].copy_(graph.run_block(1))
        emitted = verifier.collect(
            verifier.launch(k, ahead=(side.stream, guesses[0, :1])), counts)
        drafted = len(emitted) == k + 1 and emitted[-1] == verifier.guess
        if drafted:  # (on the main stream, which the check joined to the side one)
            verifier.drafts[:, :k].copy_(guesses[:, 1:])
            counts.ahead_kept += 1
        else:
            counts.ahead_dropped += 1
        synced = False
        remaining -= len(emitted)
        yield emitted
    if remaining > 0:
        if not synced:
            verifier.resync_draft()
        yield from plain_blocks(remaining, k, counts)
