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

import torch

from .short_prefill import ShortPrefill
from .states import copy_on_device, held_tensors, put_back


class ExactSide:
    def __init__(self, model, use_graphs: bool | None = None):
        self.model = model.eval()
        self.device = model.get_input_embeddings().weight.device
        self.cache = model.make_recurrent_cache()
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        # Short prompts through captured graphs (with graphs only: eager, it is only slower)
        self.short_prefill = ShortPrefill(model, self.cache, use_graphs=True) \
            if use_graphs else None
        # The modes' quantized linears by (module name, storage): unimax.fp8.quantize_view
        # stores each once, and the tail, full and int4 views hold the same modules (the
        # FP8 LM head alone is 0.64 GB at the Qwen3.5-4B shape).
        self.quantized: dict[tuple, torch.nn.Module] = {}

    @torch.inference_mode()
    def park(self, rows: int) -> tuple[list[torch.Tensor], int]:
        """A copy of the cache's state and of the first ``rows`` KV entries of each attention
        layer (a reply's prompt and reply so far, and any drafts written past them), taken as
        a conversation's kept state is (unimax.states), with the tokens it has seen."""
        rows = min(rows, self.cache.max_kv_length) if self.cache.has_attention else 0
        return copy_on_device(held_tensors(self.cache, rows)), self.cache.seen_tokens

    def unpark(self, parked: tuple[list[torch.Tensor], int]) -> None:
        """Put a parked state back (a reply's, after its prefill: unimax.states.put_back)."""
        put_back(self.cache, *parked)
