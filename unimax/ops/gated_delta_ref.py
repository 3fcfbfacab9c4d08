"""The gated delta rule's two torch references (ops.gated_delta's module docstring has the
math): the token loop (``recurrent_gated_delta_rule_ref``, also the one-token decode step) and
the chunked WY form (``chunk_gated_delta_rule_ref``, prefill and verification). Every kernel
is held to them; they import nothing of the package's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # fla's l2norm and transformers' Qwen3.5 both use 1e-6 inside the sqrt


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _prepare(q, k, v, g, beta):
    """fp32, l2-normalized, scaled, heads grouped and moved before time: (B, HV, T, .)."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads "
                         f"({num_k_heads})")
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if num_v_heads != num_k_heads:
        group = num_v_heads // num_k_heads
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    return q, k, v, g, beta


def first_steps_only(g: torch.Tensor, beta: torch.Tensor, valid: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """g, beta (B, T, H) with the steps at or past ``valid`` (a 0-d device tensor) made no-ops:
    a decay of exp(0) = 1 and a write strength of 0 leave a GDN state exactly as it was, so the
    recurrence over all T steps ends in the state after the first ``valid``."""
    live = (torch.arange(g.shape[1], device=g.device) < valid)[None, :, None]
    return g * live, beta * live.to(beta.dtype)


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, _, num_v_heads, head_v_dim = v.shape
    return v.new_zeros(batch, num_v_heads, q.shape[-1], head_v_dim, dtype=torch.float32)


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=None):
    """Token-by-token loop: the plain definition. Returns (o (B,T,HV,V) in v's dtype, state)."""
    out_dtype = v.dtype
    state = _zero_state(q, v) if initial_state is None else initial_state.float()
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]  # (B, HV, K)
        memory = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v[:, :, t] - memory) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    o = torch.stack(outputs, dim=1)  # (B, T, HV, V)
    return o.to(out_dtype), state


def chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Chunked WY form: within a chunk the T sequential rank-1 updates become one triangular
    solve and a few matmuls; across chunks the state is carried. Same result as the loop."""
    out_dtype = v.dtype
    batch, seq_len = q.shape[:2]
    state = _zero_state(q, v) if initial_state is None else initial_state.float()
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (-seq_len) % chunk_size
    if pad:
        # Padded steps have k = 0, beta = 0 and g = 0: they neither write nor decay the state.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_heads, total = q.shape[1], q.shape[2]
    num_chunks = total // chunk_size

    def chunks(x):  # (B, H, T, D) -> (B, H, N, C, D)
        return x.reshape(batch, num_heads, num_chunks, chunk_size, *x.shape[3:])

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g), chunks(beta)
    gamma = g.cumsum(-1)  # (B, H, N, C): log-decay from chunk start through position i
    idx = torch.arange(chunk_size, device=q.device)
    lower = idx[:, None] >= idx[None, :]
    strictly_lower = idx[:, None] > idx[None, :]
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i; masked before exp so nothing overflows.
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = diff.masked_fill(~lower, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # (I + M) T = I with M[i, j] = beta_i k_i.k_j decay[i, j] for j < i: the WY inverse.
    m = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)
    wy = torch.linalg.solve_triangular(m + eye, eye.expand_as(m), upper=False,
                                       unitriangular=True)
    u = wy @ (v * beta[..., None])  # values to write, before subtracting the carried state
    w = wy @ (k_beta * gamma.exp()[..., None])  # how the carried state leaks into them
    intra = (q @ k.transpose(-1, -2) * decay).masked_fill(~lower, 0.0)

    outputs = []
    for n in range(num_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state
        o = (q[:, :, n] * gamma[:, :, n, :, None].exp()) @ state + intra[:, :, n] @ v_new
        outputs.append(o)
        last = gamma[:, :, n, -1]
        k_decayed = k[:, :, n] * (last[..., None] - gamma[:, :, n]).exp()[..., None]
        state = state * last.exp()[..., None, None] + k_decayed.transpose(-1, -2) @ v_new
    o = torch.cat(outputs, dim=2)[:, :, :seq_len]  # (B, H, T, V)
    return o.transpose(1, 2).to(out_dtype), state
