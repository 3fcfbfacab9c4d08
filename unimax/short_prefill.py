"""Short prompts through captured graphs: a chat turn on kept state is tens to thousands of
tokens, and an eager forward over them is thousands of kernel launches, which cost more than
the arithmetic (issue 15: the 512-token prefill's compute floor is under 2 ms on the H200).

A prompt of T tokens runs in the graph of the smallest bucket B >= T (``BUCKETS``), padded: one
forward over B tokens on the kept state that counts only the first T (RecurrentCache.counting,
T on the device), keeping the logits of position T - 1 only. Padding therefore never reaches the
state: in GDN layers the steps past T have g = 0 and beta = 0, which leave the recurrent state
exactly as it was, and the conv window is taken after input T; the position advances by T, so
attention's KV past it is written but never read; and no row before T sees a padded position
(causal). One graph serves a whole bucket. (The verifier, which learns how many of its tokens
count only after its forward, rewinds from a tape instead: unimax.tape.)
Graphs are keyed by (B, KV window) and captured with the engine's (``capture``).
"""

from __future__ import annotations

import torch

from .cache import RecurrentCache
from .graph import GraphRunner
from .model import CausalLMOutput

# Up to 4096 tokens since the H200 showed an eager prompt of 1000 tokens costing as much as one
# of 4096 (~45 ms on the 0.8B hybrid shape: launches, not arithmetic); in the 1024 bucket it
# took 10.1 ms and 4096 tokens 31.0 (bench/RESULTS.md). Up to 1024
# the buckets double (a prompt may run up to twice its tokens, cheap at those lengths); above,
# they are 1024 apart, so a prompt runs at most 1.5x its tokens (2049 in the 3072 bucket).
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096)


class ShortPrefill:
    def __init__(self, model, cache: RecurrentCache, use_graphs: bool,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model, self.cache, self.buckets = model, cache, tuple(sorted(buckets))
        self.max_tokens = self.buckets[-1]
        long = dict(dtype=torch.long, device=cache.device)
        self.inputs = torch.zeros(1, self.max_tokens, **long)
        self.length = torch.ones(1, **long)  # T, on the device (a valid T for every bucket)
        self.logits = torch.zeros(1, 1, model.config.vocab_size, dtype=model.dtype,
                                  device=cache.device)
        self.runner = GraphRunner(cache.device, use_graphs)

    def bucket(self, tokens: int) -> int | None:
        """The padded length for a prompt of ``tokens`` on the current state, or None when it
        does not fit a bucket (or the padded KV would pass the buffers' end)."""
        span = next((b for b in self.buckets if b >= tokens), None)
        if span is None or tokens < 1:
            return None
        if self.cache.has_attention and self.cache.seen_tokens + span > self.cache.max_kv_length:
            return None
        return span

    def _body(self, span: int) -> None:
        with self.cache.counting(self.length[0]):
            logits = self.model.forward_unchecked(self.inputs[:, :span], self.cache,
                                                  keep_rows=self.length - 1)
        self.logits.copy_(logits)

    def _buffers(self) -> list[torch.Tensor]:
        return [self.inputs, self.length, self.logits]

    def _run(self, span: int, window) -> None:
        with self.cache.attending(window):
            self.runner.run(("prefill", span, window), lambda: self._body(span),
                            writes=[self.cache], buffers=self._buffers())

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> CausalLMOutput:
        """Prefill ``input_ids`` (1, T) on the cache's state (``bucket(T)`` must not be None);
        returns the last position's logits (1, 1, V), valid until the next call."""
        tokens = int(input_ids.shape[1])
        span = self.bucket(tokens)
        if span is None:
            raise ValueError(f"a short prefill takes 1..{self.max_tokens} tokens that fit the "
                             f"KV buffers, got {tokens}")
        seen = self.cache.seen_tokens
        self.inputs[:, :tokens].copy_(input_ids)
        self.inputs[:, tokens:span].zero_()
        self.length.fill_(tokens)
        self._run(span, self.cache.window_for(seen + span))
        self.cache.seen_tokens = seen + tokens
        return CausalLMOutput(self.logits, self.cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (bucket, KV window) graph a short prompt can meet. Caches left as they were."""
        # the warm-up runs each body on the buffers as they are: after a 512-token prompt the
        # length says 512, out of range for the 16-token bucket (a device-side assert)
        self.length.fill_(1)
        for window in self.cache.windows():
            for span in self.buckets:
                if window is not None and span > window:
                    continue
                with self.cache.attending(window):
                    self.runner.prepare(("prefill", span, window), lambda s=span: self._body(s),
                                        writes=[self.cache], buffers=self._buffers())
