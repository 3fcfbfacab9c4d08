"""Kept conversation states: the recurrent model's advantage is that a whole conversation's
context is a fixed few megabytes, so every finished turn is kept and the next turn prefills only
its new tokens. Regenerate and edit fall back to the longest kept prefix of the new prompt.

States live on the GPU up to a byte budget; the least recently used move to host memory, and past
the host budget the least recently used are dropped (that costs only a longer prefill later).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from .cache import RecurrentCache, kv_tensors, state_tensors


# eq=False: a state is itself, not its fields; two conversations can keep equal token
# histories, and comparing their tensors raises (the budget's drop finds its state by identity)
@dataclass(eq=False)
class KeptState:
    tokens: tuple[int, ...]  # the exact token history this state has absorbed
    tensors: list[torch.Tensor]  # the fixed-size state, then (hybrid models) KV[:len] per layer
    last_used: int = 0
    num_state: int = -1  # how many of ``tensors`` are the fixed-size state
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def on_gpu(self) -> bool:
        return self.tensors[0].is_cuda


class StateStore:
    """Checkpoints per conversation id. Thread-safe; the engine thread does the copies."""

    def __init__(self, gpu_budget_bytes: int, host_budget_bytes: int):
        self.gpu_budget = gpu_budget_bytes
        self.host_budget = host_budget_bytes
        self.conversations: dict[str, list[KeptState]] = {}
        self.clock = itertools.count(1)
        self.lock = threading.Lock()

    def best_prefix(self, conversation_id: str, tokens: list[int]) -> KeptState | None:
        """The kept state with the longest history that is a strict prefix of ``tokens`` (at
        least one new token must remain: its logits give the first reply token)."""
        with self.lock:
            best = None
            for ckpt in self.conversations.get(conversation_id, []):
                n = len(ckpt.tokens)
                if n < len(tokens) and tuple(tokens[:n]) == ckpt.tokens and \
                        (best is None or n > len(best.tokens)):
                    best = ckpt
            if best is not None:
                best.last_used = next(self.clock)
            return best

    @torch.inference_mode()
    def save(self, conversation_id: str, tokens: list[int], cache: RecurrentCache) -> None:
        held = held_tensors(cache, len(tokens))
        try:
            tensors = copy_on_device(held)
        except torch.OutOfMemoryError:
            # a card full to the brim (a big model on a 24 GB L4): the copy goes to host
            # memory instead, where the budget would have moved it anyway; the reply that is
            # being served must not fail for the sake of a later turn's prefill
            tensors = [t.to("cpu") for t in held]
        ckpt = KeptState(tuple(tokens), tensors, last_used=next(self.clock),
                          num_state=len(state_tensors(cache)))
        with self.lock:
            kept = [c for c in self.conversations.get(conversation_id, [])
                    if c.tokens != ckpt.tokens]
            self.conversations[conversation_id] = kept + [ckpt]
            self._enforce_budgets()

    @torch.inference_mode()
    def restore(self, ckpt: KeptState, cache: RecurrentCache) -> None:
        put_back(cache, ckpt.tensors, len(ckpt.tokens))

    def forget(self, conversation_id: str) -> None:
        with self.lock:
            self.conversations.pop(conversation_id, None)

    def usage(self) -> dict:
        with self.lock:
            all_ckpts = [c for cs in self.conversations.values() for c in cs]
            return {"conversations": len(self.conversations), "states": len(all_ckpts),
                    "gpu_mib": sum(c.nbytes for c in all_ckpts if c.on_gpu) / 2**20,
                    "host_mib": sum(c.nbytes for c in all_ckpts if not c.on_gpu) / 2**20}

    def _enforce_budgets(self) -> None:
        ckpts = sorted((c for cs in self.conversations.values() for c in cs),
                       key=lambda c: c.last_used)
        gpu = sum(c.nbytes for c in ckpts if c.on_gpu)
        for ckpt in ckpts:  # oldest first
            if gpu <= self.gpu_budget:
                break
            if ckpt.on_gpu:
                ckpt.tensors = [t.to("cpu", non_blocking=False) for t in ckpt.tensors]
                gpu -= ckpt.nbytes
        host = sum(c.nbytes for c in ckpts if not c.on_gpu)
        for ckpt in ckpts:
            if host <= self.host_budget:
                break
            if not ckpt.on_gpu:
                for cid, cs in list(self.conversations.items()):
                    if ckpt in cs:
                        cs.remove(ckpt)
                        if not cs:  # the panel counts conversations with a kept state
                            del self.conversations[cid]
                host -= ckpt.nbytes


def held_tensors(cache: RecurrentCache, rows: int) -> list[torch.Tensor]:
    """What a cache holds after ``rows`` tokens: the fixed-size state, then (hybrid models) each
    attention layer's first ``rows`` KV entries (views, not copies)."""
    return state_tensors(cache) + [t[:, :, :rows] for t in kv_tensors(cache)]


@torch.inference_mode()
def put_back(cache: RecurrentCache, tensors: list[torch.Tensor], seen: int) -> None:
    """Copy ``held_tensors``' copies back into the cache (its addresses kept: graphs read
    them), as the state after ``seen`` tokens."""
    n = len(state_tensors(cache))
    for dst, src in zip(state_tensors(cache), tensors[:n], strict=True):
        dst.copy_(src, non_blocking=True)
    for dst, src in zip(kv_tensors(cache), tensors[n:], strict=True):
        dst[:, :, :src.shape[2]].copy_(src, non_blocking=True)
    for layer in cache.layers:
        layer.has_previous_state[0] = True
    cache.seen_tokens = seen


def copy_on_device(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A kept state's copy beside the cache it comes from (the fast restore)."""
    return [t.clone() for t in tensors]
