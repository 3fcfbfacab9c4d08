"""The verifier's tape: what each GDN layer fed its recurrence during a verified block, so that
the state after any accepted prefix can be rebuilt without a second forward.

A rejection at position j of a k-token block leaves the exact cache past the accepted prefix.
Replaying the prefix through the model would read every weight again (a second forward per
rejected block). Instead the verifier's forward records, per GDN layer and token, the inputs of
the two stateful parts: the short convolution's input and the gated delta rule's (q, k, v, g,
beta). From the state before the block (the snapshot) the state after L tokens is then the
convolution window over the first L recorded inputs and the recurrence run over L recorded
steps: no weights, no attention, no MLPs. Attention KV rolls back by position alone.

Buffers are allocated once for the largest block and written with ``copy_`` (graph-safe).
"""

from __future__ import annotations

import torch


class LayerTape:
    """One GDN layer's recorded inputs: views into the Tape's tensors (batch 1)."""

    def __init__(self, tape: Tape, index: int):
        self.max_tokens = tape.max_tokens
        self.buffers = [t[index:index + 1] for t in tape.tensors()]

    @torch.no_grad()
    def record(self, conv_input, q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
        """Copy one forward's per-token inputs (B=1, T <= max_tokens) into the tape; returns
        the tape's views of q, k, v, g and beta (contiguous, the values copied: the
        recurrence reads them there)."""
        t = conv_input.shape[1]
        if t > self.max_tokens:
            raise ValueError(f"the tape holds {self.max_tokens} tokens, the forward fed {t}")
        for buffer, value in zip(self.buffers, (conv_input, q, k, v, g, beta), strict=True):
            buffer[:, :t].copy_(value)
        return self.recurrence_inputs(t)

    def recurrence_inputs(self, length: int) -> tuple[torch.Tensor, ...]:
        """(q, k, v, g, beta) of the first ``length`` recorded tokens: the tape's views."""
        return tuple(buffer[:, :length] for buffer in self.buffers[1:])


class Tape:
    """Every GDN layer's tape in one tensor per input, the layers along the batch dimension,
    so a rewind is one recurrence launch for all layers (the cache's states are flat buffers in
    the same layer order: unimax.cache)."""

    def __init__(self, is_gdn: list[bool], max_tokens: int, conv_dim: int, num_k_heads: int,
                 head_k_dim: int, num_v_heads: int, head_v_dim: int, dtype: torch.dtype,
                 device: torch.device):
        """``is_gdn``: per model layer, whether it is a GDN layer (attention layers: no tape)."""
        n, t = sum(is_gdn), max_tokens
        self.max_tokens = max_tokens
        self.conv_input = torch.zeros(n, t, conv_dim, dtype=dtype, device=device)
        self.q = torch.zeros(n, t, num_k_heads, head_k_dim, dtype=dtype, device=device)
        self.k = torch.zeros_like(self.q)
        self.v = torch.zeros(n, t, num_v_heads, head_v_dim, dtype=dtype, device=device)
        self.g = torch.zeros(n, t, num_v_heads, dtype=torch.float32, device=device)
        self.beta = torch.zeros(n, t, num_v_heads, dtype=dtype, device=device)
        # Per model layer: its LayerTape, or None for an attention layer.
        index = iter(range(n))
        self.layers = [LayerTape(self, next(index)) if gdn else None for gdn in is_gdn]

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_input, self.q, self.k, self.v, self.g, self.beta]

    def recurrence_inputs(self, length: int):
        """(q, k, v, g, beta) of the first ``length`` recorded tokens, layers as the batch."""
        return (self.q[:, :length], self.k[:, :length], self.v[:, :length],
                self.g[:, :length], self.beta[:, :length])
