"""The exact reference every fast path is held to: prefill, then one greedy step per token."""

from __future__ import annotations

import torch


@torch.inference_mode()
def exact_greedy_tokens(model, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of ``input_ids`` (B, T): (B, max_new_tokens) token ids."""
    n = int(max_new_tokens)
    if n < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {n}")
    if n == 0:
        return torch.empty((input_ids.shape[0], 0), dtype=torch.long, device=input_ids.device)
    cache = model.make_recurrent_cache(input_ids.shape[0])
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    pieces = [token]
    for _ in range(n - 1):
        token = model.greedy_step(token, cache)
        pieces.append(token)
    return torch.cat(pieces, dim=1)
