"""The exact side every mode shares: one exact model, its cache (the attention KV buffers on
hybrid models), the short prefill's graphs and the quantized linears the modes' views hold.

Each mode's engine (``build_engine(exact=...)``) decodes with views and graphs of its own and
prefills, verifies and finishes on this side, so a second or third mode costs its decoder and
nothing more: no second max_context KV buffer, no second set of prefill graphs, no second FP8
copy of the LM head. One request runs at a time on the engine thread, and each starts by
restoring its conversation's kept state or from empty, so the modes never see each other's
state; replies that race side by side (EngineService.race) swap it at each turn (``park``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import FLAG_TABLES, kv_tensors, state_tensors
from .short_prefill import ShortPrefill


@dataclass
class Parked:
    """One reply's exact state set aside while another runs (``ExactSide.park``)."""

    state: list[torch.Tensor]  # conv and recurrent buffers and the position
    kv: list[torch.Tensor]  # each attention layer's keys and values, its first ``rows``
    flags: list[dict]  # each layer's flag tables
    seen_tokens: int


class ExactSide:
    def __init__(self, model, use_graphs: bool | None = None):
        self.model = model.eval()
        self.device = model.get_input_embeddings().weight.device
        self.cache = model.make_recurrent_cache()
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        self.use_graphs = use_graphs
        # Short prompts through captured graphs (with graphs only: eager, it is only slower)
        self.short_prefill = ShortPrefill(model, self.cache, use_graphs=True) \
            if use_graphs else None
        # The modes' quantized linears by (module name, storage): unimax.fp8.quantize_view
        # stores each once, and the tail, full and int4 views hold the same modules (the
        # FP8 LM head alone is 0.64 GB at the Qwen3.5-4B shape).
        self.quantized: dict[tuple, torch.nn.Module] = {}

    @torch.inference_mode()
    def park(self, rows: int) -> Parked:
        """A copy of the cache's state and of the first ``rows`` KV entries of each attention
        layer (a reply's prompt and reply so far, and any drafts written past them)."""
        rows = min(rows, self.cache.max_kv_length) if self.cache.has_attention else 0
        return Parked([t.clone() for t in state_tensors(self.cache)],
                      [t[:, :, :rows].clone() for t in kv_tensors(self.cache)],
                      [_flags(layer) for layer in self.cache.layers],
                      int(self.cache.seen_tokens))

    @torch.inference_mode()
    def unpark(self, parked: Parked) -> None:
        """Put a parked state back (the cache's addresses kept: graphs read them)."""
        for dst, src in zip(state_tensors(self.cache), parked.state, strict=True):
            dst.copy_(src)
        for dst, src in zip(kv_tensors(self.cache), parked.kv, strict=True):
            dst[:, :, :src.shape[2]].copy_(src)
        for layer, flags in zip(self.cache.layers, parked.flags, strict=True):
            for table, values in flags.items():
                getattr(layer, table).clear()
                getattr(layer, table).update(values)
        self.cache.seen_tokens = parked.seen_tokens


def _flags(layer) -> dict:
    return {table: dict(getattr(layer, table)) for table in FLAG_TABLES if hasattr(layer, table)}
