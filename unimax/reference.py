"""The exact reference every fast path is held to: prefill, then one greedy step per token."""

from __future__ import annotations

import copy
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


def float32_twin(model):
    """A copy of ``model`` with every weight upcast to float32 (exactly: each BF16 value is a
    float32 value) and the gated delta rule's torch form (its kernels' fp32 accumulation
    throughout): the same function the BF16 weights define, computed without BF16
    activations' rounding. first_divergence asks it which of two near-tied tokens the model
    itself ranks higher (the BF16 one-token reference is one rounding of that function, the
    verifier's block forward another)."""
    twin = copy.deepcopy(model).float()
    twin.set_backend("torch")
    return twin


def float32_logits(twin, ids: torch.Tensor) -> torch.Tensor:
    """The twin's last-position logits for ``ids`` (1, T), one forward, no cache, with no
    TF32 anywhere (its matmuls and the conv in full float32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return twin(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@torch.inference_mode()
def first_divergence(model, input_ids: torch.Tensor, tokens: list[int],
                     reference: list[int], twin=None) -> dict | None:
    """Where ``tokens`` first leaves the greedy ``reference`` (both continuations of
    ``input_ids``), and how close the reference's choice was there: the step-by-step logit
    gap between the two tokens, absolute and over the logits' standard deviation. A BF16 block
    forward and a one-token step round differently, so at a near-tie they can pick different
    tokens; a large gap would mean a bug. With ``twin`` (float32_twin of ``model``), also
    the float32 computation's gap between the same two tokens (positive: it ranks the
    reference's token higher; negative: the other's) and how far the reference's two logits
    lie from it: where that distance exceeds the float32 gap, the BF16 reference was itself
    inside its rounding of the model's choice."""
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
    found = {"index": index, "gap": gap, "gap_over_std": gap / float(logits.float().std()),
             "gap_bf16_ulps": gap / ulp, "exact_paths_differ_by": noise}
    if twin is not None:
        exact = float32_logits(twin, whole)
        pair = torch.tensor([want, got], device=exact.device)
        found["float32_gap"] = float(exact[want] - exact[got])
        found["reference_off_float32"] = float((logits.float()[pair] - exact[pair]).abs().max())
    return found


def is_near_tie(divergence: dict | None) -> bool:
    """No divergence, or one where the reference's two logits were closer than twice what its
    two exact paths (one-token steps, one forward) differ by at that position: a disagreement
    two correct BF16 computations of the model can have (different kernels, a k-token block
    against one-token steps), or no more than one BF16 ulp apart: where the two exact paths
    happen to agree (differ by 0), a third, the verifier's block forward, may still round one
    ulp the other way (the GPU tests' tiny model: a gap of one ulp, paths
    equal). A bug shows as a gap far past that."""
    if divergence is None:
        return True
    return (divergence["gap"] <= 2 * divergence["exact_paths_differ_by"]
            or divergence["gap_bf16_ulps"] <= 1.0)
