"""Qwen3.5's gated attention layer over a static KV buffer (the hybrid models' 1-in-4 layers).

q_proj carries a per-head output gate ([q_h, gate_h] side by side for each head), q and k get a
per-head RMSNorm (scaled by 1 + w), partial rotary embedding, grouped KV heads, and the output
is multiplied by sigmoid(gate) before o_proj. Port of transformers' ``Qwen3_5Attention``
(models/qwen3_5/modeling_qwen3_5.py); for text the multimodal rotary sections all see the same
positions, which is plain RoPE on the first ``rotary_dim`` channels.

With a cache, new keys/values are written at the cache's device-side position and every query
attends over the leading ``attend_length`` entries of the buffer under a mask (key index <= query
position): fixed shapes and no host sync, so the step can be captured in a CUDA graph.
``attend_length`` is the whole buffer unless the host set a window (RecurrentCache.set_window). A
step of up to the kernel configuration's ``decode_attention_tokens`` tokens over a graph's window
(one-token decode steps, the verifier's blocks) goes through ops.decode_attention, which reads the
position on the device and only the entries up to each token's: one graph serves every length (SDPA
over the whole buffer under the mask cost 18-65 us per layer at 4B heads on the H200 for 2k-32k
buffers, whatever the conversation's length; the kernel 7 us at 512 stored entries,
bench/decode_attention.py). Several query rows under a mask (the verifier's block) are SDPA's slow
case, 215 us per layer over 4k keys and 66 us over 512: where the op does not serve (no CUDA kernel
for the shape, autograd recording, longer blocks) the verifier's graphs are keyed by bucket
(engine.py) and rows_attention reads the bucket; eager forwards read exactly the stored entries
(model.py). There the mask is not needed at all: the queries are the window's last T positions,
which is causal attention aligned to the bottom right. A prefill from an empty cache runs SDPA's
causal kernel (flash) on the new keys themselves; one on top of kept KV passes
``causal_lower_right`` (flash / memory-efficient kernels on CUDA, the same mask materialized
elsewhere); a one-token eager step needs no mask. A 16k-token prefill's attention through the mask
took 8.6 ms per layer on the H200, against 1.6 ms in transformers' causal call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from . import kernels
from .cache import AttentionLayerState
from .config import GDNConfig
from .norms import RMSNorm
from .ops.decode_attention import decode_attention, supported

# Which forms attend is the kernel configuration's (unimax.kernels): up to its
# ``decode_attention_tokens`` tokens over a graph's window through ops.decode_attention (every
# decode step, the verifier's blocks of k drafts + 1, the short prefill's 16-token bucket),
# which reads only the entries stored so far, instead of SDPA over the whole buffer under a
# mask; off CUDA the op is that masked SDPA itself, and a forward that autograd records keeps
# SDPA (the op has no backward). Where the op does not serve, up to ``rows_attention_max``
# query rows under a mask go through ``rows_attention`` (SDPA's masked multi-row case is the
# slow one: 8 rows over a 4k window 259 against 414 us on the H200), its two matmuls on the
# tensor cores on CUDA (in fp32 they were cuBLAS's FFMA kernels, 33 us per attention layer of
# a 0.8B verify block).


def takes_kernel(tokens: int, q: torch.Tensor, state: AttentionLayerState) -> bool:
    """Whether a forward of ``tokens`` tokens over a graph's window attends through
    ops.decode_attention: as many as the kernel configuration lets, a head size and caches the
    kernel takes (the layer's dispatch; autograd recording aside)."""
    return tokens <= kernels.active().decode_attention_tokens and supported(
        q, state.key_cache, state.value_cache)


def kernel_attends(cache, tokens: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether every attention call of a captured forward of up to ``tokens`` tokens on
    ``cache`` goes through ops.decode_attention's kernel (takes_kernel on CUDA), so that the KV
    window it is given changes nothing it computes."""
    query = torch.empty(1, 1, head_dim, dtype=dtype, device="meta")  # a query's size, dtype
    return cache.device.type == "cuda" and all(
        takes_kernel(tokens, query, layer) for layer in cache.layers
        if isinstance(layer, AttentionLayerState))


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float, tensor_cores: bool | None = None) -> torch.Tensor:
    """Attention as two matmuls and a softmax, for few query rows: q (B, H, T, D) over k, v
    (B, KVH, L, D) with a boolean mask (T, L). The g query heads of a KV head become g * T rows
    against that head (no copy of K or V per query head); softmax in fp32.

    Scores: BF16 products are exact in fp32, so BF16 inputs with fp32 accumulation (the tensor
    cores, ``torch.bmm(..., out_dtype=float32)``, CUDA only) give the fp32 form's scores to
    summation order. Output: the probabilities rounded to the activation dtype before the
    product with V, as flash attention and cuDNN's SDPA (the one-token step's) round them;
    the fp32 form keeps them fp32. ``tensor_cores``: None = on CUDA for BF16/FP16 inputs."""
    batch, heads, rows, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * rows, dim)
    mask = mask.repeat(group, 1)
    if tensor_cores is None:
        tensor_cores = q.is_cuda and q.dtype != torch.float32
    if tensor_cores:
        scores = _bmm_fp32(grouped, k.transpose(-1, -2)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
        out = _bmm_fp32(probs, v)
    else:
        scores = (grouped.float() @ k.float().transpose(-1, -2)) * scale
        out = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v.float()
    return out.reshape(batch, heads, rows, dim).to(q.dtype)


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, H, M, K) @ b (B, H, K, N) with fp32 output from BF16/FP16 inputs (CUDA), batch and
    heads flattened (views at batch 1: the cache's slices are not copied)."""
    out = torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out_dtype=torch.float32)
    return out.unflatten(0, a.shape[:2])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.config = config
        heads, kv_heads, dim = (config.num_attention_heads, config.num_key_value_heads,
                                config.attn_head_dim)
        self.sizes = (heads * dim * 2, kv_heads * dim, kv_heads * dim)
        self.in_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=False)
        self.q_norm = RMSNorm(dim, config.norm_eps, config.norm_offset)
        self.k_norm = RMSNorm(dim, config.norm_eps, config.norm_offset)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=False)
        self.rotary_dim = int(dim * config.partial_rotary_factor)

    def rope(self, q, k, positions):
        """Rotate the first rotary_dim channels of q, k (B, H, T, D) by their positions (T,).
        The frequencies are computed here, not kept in a buffer: models are built on the meta
        device and a non-persistent buffer would never be loaded."""
        exponent = torch.arange(0, self.rotary_dim, 2, device=q.device,
                                dtype=torch.float32) / self.rotary_dim
        inv_freq = 1.0 / self.config.rope_theta ** exponent
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        r = self.rotary_dim

        def apply(x):
            rot, rest = x[..., :r], x[..., r:]
            return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

        return apply(q), apply(k)

    def forward(self, x: torch.Tensor, state: AttentionLayerState | None) -> torch.Tensor:
        out, gate = self.core(self.in_proj(x), state)
        return self.o_proj(out * torch.sigmoid(gate))

    def core(self, projected: torch.Tensor, state: AttentionLayerState | None):
        """From the in-projection's output (B, T, .) to the attention output and its gate, both
        (B, T, heads * dim), before ``o_proj(out * sigmoid(gate))``: the forward's middle,
        shared with the draft's fused block (unimax.fused_draft), which folds the gate into
        the out-projection."""
        cfg = self.config
        batch, seq_len, _ = projected.shape
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attn_head_dim
        qg, k, v = torch.split(projected, self.sizes, dim=-1)
        qg = qg.view(batch, seq_len, heads, 2 * dim)
        q, gate = qg[..., :dim], qg[..., dim:].reshape(batch, seq_len, heads * dim)
        q = self.q_norm(q).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(k.view(batch, seq_len, kv_heads, dim)).transpose(1, 2)
        v = v.view(batch, seq_len, kv_heads, dim).transpose(1, 2)
        offsets = torch.arange(seq_len, device=projected.device)
        positions = offsets if state is None else state.position + offsets
        q, k = self.rope(q, k, positions)
        scale = dim ** -0.5
        if state is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=heads != kv_heads)
        else:
            with torch.no_grad():  # the cache is state, outside autograd (see layers.py)
                state.key_cache.index_copy_(2, positions, k.to(state.key_cache.dtype))
                state.value_cache.index_copy_(2, positions, v.to(state.value_cache.dtype))
            state.has_previous_state[0] = True
            length = state.attend_length  # the host's window (cache.set_window) or all
            gqa = heads != kv_heads
            if state.window_exact and length == seq_len:  # from an empty cache
                out = F.scaled_dot_product_attention(q, k, v, is_causal=seq_len > 1,
                                                     scale=scale, enable_gqa=gqa)
            elif not state.window_exact and takes_kernel(seq_len, q, state) and \
                    not (q.requires_grad and torch.is_grad_enabled()):
                out = decode_attention(q, state.key_cache, state.value_cache, positions, scale)
            else:
                cached_k, cached_v = (state.key_cache[:, :, :length].to(q.dtype),
                                      state.value_cache[:, :, :length].to(q.dtype))
                if state.window_exact:  # on kept KV: the queries are the last seq_len keys
                    mask = causal_lower_right(seq_len, length) if seq_len > 1 else None
                else:  # a graph's window: entries past the position are not written yet
                    keys = torch.arange(length, device=projected.device)
                    mask = keys[None, :] <= positions[:, None]  # (T, L)
                if mask is not None and not state.window_exact and \
                        1 < seq_len <= kernels.active().rows_attention_max:
                    out = rows_attention(q, cached_k, cached_v, mask, scale)
                else:
                    out = F.scaled_dot_product_attention(q, cached_k, cached_v, attn_mask=mask,
                                                         scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(batch, seq_len, heads * dim), gate
