"""The exact reference every fast path is held to: prefill, then one greedy step per token."""

from __future__ import annotations

import math

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


@torch.inference_mode()
def first_divergence(model, input_ids: torch.Tensor, tokens: list[int],
                     reference: list[int]) -> dict | None:
    """Where ``tokens`` first leaves the greedy ``reference`` (both continuations of
    ``input_ids``), and how close the reference's choice was there: the step-by-step logit
    gap between the two tokens, absolute and over the logits' standard deviation. A BF16 block
    forward and a one-token step round differently, so at a near-tie they can pick different
    tokens; a large gap would mean a bug."""
    pairs = zip(tokens, reference, strict=False)
    index = next((i for i, (got, want) in enumerate(pairs) if got != want), None)
    if index is None:
        return None
    got, want = tokens[index], reference[index]
    cache = model.make_recurrent_cache()
    logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits[0, -1]
    for token in reference[:index]:
        logits = model(input_ids=torch.tensor([[token]], device=input_ids.device),
                       past_key_values=cache, logits_to_keep=1).logits[0, -1]
    gap = float(logits[want].float() - logits[got].float())
    top = max(abs(float(logits[want])), abs(float(logits[got])), 2.0 ** -126)
    ulp = 2.0 ** (math.floor(math.log2(top)) - 7)  # BF16 keeps 8 significant bits
    # The same logits from the other exact path (one forward over the prefix instead of
    # one-token steps): how far two correct computations of this model differ here.
    prefix = torch.tensor([reference[:index]], dtype=torch.long, device=input_ids.device)
    whole = torch.cat([input_ids, prefix], dim=1) if index else input_ids
    other = model(input_ids=whole, logits_to_keep=1).logits[0, -1]
    noise = float((logits.float() - other.float()).abs().max())
    return {"index": index, "gap": gap, "gap_over_std": gap / float(logits.float().std()),
            "gap_bf16_ulps": gap / ulp, "exact_paths_differ_by": noise}


def is_near_tie(divergence: dict | None) -> bool:
    """No divergence, or one where the reference's two logits were closer than twice what its
    two exact paths (one-token steps, one forward) differ by at that position: a disagreement
    two correct BF16 computations of the model can have (different kernels, a k-token block
    against one-token steps), or no more than one BF16 ulp apart: where the two exact paths
    happen to agree (differ by 0), a third, the verifier's block forward, may still round one
    ulp the other way (thirtieth session, the GPU tests' tiny model: a gap of one ulp, paths
    equal). A bug shows as a gap far past that."""
    if divergence is None:
        return True
    return (divergence["gap"] <= 2 * divergence["exact_paths_differ_by"]
            or divergence["gap_bf16_ulps"] <= 1.0)
