"""Gated delta rule: pure functions, ``(q, k, v, g, beta, state) -> (o, final_state)``.

Shapes: q, k (B, T, H, K); v (B, T, HV, V); g, beta (B, T, HV); state (B, HV, K, V), fp32.
``g`` is the log-decay (<= 0) and ``beta`` the write strength, both already activated; q and k
are raw and L2-normalized here, as fla's ``use_qk_l2norm_in_kernel=True`` does. Value heads are
grouped over key heads: value head i reads key head ``i // (HV // H)`` (repeat_interleave).

Per token, with q scaled by K**-0.5:
    S <- S * exp(g);  S <- S + k (beta * (v - k^T S));  o = q^T S
(Yang et al., "Gated Delta Networks", https://arxiv.org/abs/2412.06464.)

Two torch references live here: the token loop (``recurrent_gated_delta_rule_ref``, also the
one-token decode step) and the chunked WY form (``chunk_gated_delta_rule_ref``) used for prefill
and verification. ``gated_delta_rule`` dispatches to flash-linear-attention's Triton kernels on
CUDA when fla is importable; tests hold every path to the same numbers.
"""

from __future__ import annotations

import torch

from .fla import fla_ops, fla_run
from .gated_delta_ref import (  # noqa: F401 (the references, as this module's)
    L2_EPS,
    chunk_gated_delta_rule_ref,
    first_steps_only,
    l2norm,
    recurrent_gated_delta_rule_ref,
)
from .short_recurrence import SHORT_MAX, short_gated_delta_rule


def fla_gated_delta_rule(q, k, v, g, beta, initial_state=None, final_state: bool = True):
    """fla's kernels with our semantics: chunked for prefill, fused recurrent for short runs;
    2 to 33 tokens outside autograd (the verifier's blocks and rewinds, short prompts) through
    ops.short_recurrence, which times fla's fused recurrent kernel against ours per shape."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    if 1 < q.shape[1] <= SHORT_MAX and not grad:
        o, state = short_gated_delta_rule(q, k, v, g, beta, initial_state, final_state)
        return o, (state if final_state else None)
    chunk, fused_recurrent = fla_ops()
    return fla_run(fused_recurrent if q.shape[1] <= 64 else chunk, q, k, v, g, beta,
                   initial_state, final_state)


def gated_delta_rule(q, k, v, g, beta, initial_state=None, backend: str = "auto",
                     final_state: bool = True):
    """Dispatch: 'fla' (CUDA + fla), 'chunk' or 'recurrent' (torch), 'torch' (chunk for
    several tokens, recurrent for one), or 'auto' (fla where it can run, else 'torch').
    ``final_state=False``: the caller does not need the state after the run (fla then does not
    write it; the torch forms compute it anyway and it is returned)."""
    if backend == "auto":
        backend = "fla" if q.is_cuda and fla_ops() is not None else "torch"
    if backend == "torch":
        backend = "recurrent" if q.shape[1] == 1 else "chunk"
    if backend == "fla":
        return fla_gated_delta_rule(q, k, v, g, beta, initial_state, final_state)
    if backend == "chunk":
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state)
    if backend == "recurrent":
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state)
    raise ValueError(f"unknown gated delta rule backend {backend!r}; "
                     "use 'auto', 'fla', 'torch', 'chunk' or 'recurrent'")
