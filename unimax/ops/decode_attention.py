"""One query token's attention over a static KV buffer, reading only the entries written so far:
``decode_attention(q, key_cache, value_cache, position, scale) -> out``.

Why: a captured decode step has fixed shapes, so torch's SDPA there reads the whole buffer
under a mask (keys at or below the position), whatever the conversation's length. On the H200
that cost 19 us per attention layer at a 4k buffer and 45 at 32k, against 10 for the stored
entries alone (bench/attention.py, bench/RESULTS.md, third session); on an L4 the whole buffer's
bytes are what count: a Qwen3.5-4B preset's 8 attention layers over 8k-entry buffers read 268 MB
a token beside the weights' 8.4 GB, at 32k 1.07 GB. Every one-token step pays it: BF16-only,
the FP8 draft's steps and the verifier's exact runs.

Here the position is read on the device, so one launch serves every step of a graph: the
key blocks below position + 1 are split over SPLITS programs per KV head (each holding its
KV head's query heads as rows of one tensor-core product), and a second launch combines the
splits' partial softmaxes (flash decoding). Off CUDA the op runs its twin,
``decode_attention_ref``: SDPA over the whole buffer under the position's mask, which is what
the graphs ran before. The field's packaged form of the same thing (flash-attn's
``flash_attn_with_kvcache`` with device-side sequence lengths) is a compiled CUDA package
outside our dependencies; FlexAttention's block-sparse decoding is not yet measured.

Shapes: q (B, H, D); the caches (B, KVH, L, D) with H a multiple of KVH and D a power of two
(16 or more), the same dtype as q; position: the number of entries before this token (a
device integer tensor, its first element read), the token's own entry already written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemv import _interpreted

# Keys per block (one tensor-core product with the query rows) and programs per KV head.
# Chosen on the H200 by bench/attention.py's "split" rows; SPLITS is capped so a batch's
# programs stay near one wave.
BLOCK_N = 32
SPLITS = 64
WARPS = 4
PROGRAMS = 128  # the SPLITS cap: about one H200 wave of programs for the whole batch


def decode_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         position: torch.Tensor, scale: float) -> torch.Tensor:
    """The twin: SDPA over the whole buffer, keys past the position masked."""
    keys = torch.arange(key_cache.shape[2], device=q.device)
    mask = keys[None, :] <= position.reshape(-1)[:1, None]
    out = F.scaled_dot_product_attention(q[:, :, None], key_cache, value_cache, attn_mask=mask,
                                         scale=scale,
                                         enable_gqa=q.shape[1] != key_cache.shape[1])
    return out[:, :, 0]


def check_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               position: torch.Tensor) -> None:
    batch, heads, dim = q.shape if q.dim() == 3 else (None,) * 3
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape or \
            key_cache.shape[0] != batch or key_cache.shape[3] != dim or \
            heads % key_cache.shape[1]:
        raise ValueError(f"decode_attention: q (B, H, D) and key/value caches (B, KVH, L, D) "
                         f"with H a multiple of KVH; got q {tuple(q.shape)}, keys "
                         f"{tuple(key_cache.shape)}, values {tuple(value_cache.shape)}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention: the caches must be in q's dtype ({q.dtype}); got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    if position.dtype not in (torch.int32, torch.int64) or position.numel() < 1:
        raise ValueError(f"decode_attention: position must be an integer tensor (the entries "
                         f"stored before this token); got {position.dtype} "
                         f"{tuple(position.shape)}")


def supported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (else callers keep SDPA): a head size the
    kernel's ranges can span, caches in q's dtype, last dimensions contiguous."""
    dim = q.shape[-1]
    return (dim >= 16 and dim & (dim - 1) == 0 and key_cache.dtype == q.dtype
            and value_cache.dtype == q.dtype and key_cache.stride(-1) == 1
            and value_cache.stride(-1) == 1)


def splits_for(batch: int, kv_heads: int, max_length: int, block_n: int = BLOCK_N,
               splits: int = SPLITS) -> int:
    """SPLITS, fewer where the batch's KV heads already fill PROGRAMS or the buffer has fewer
    blocks; a power of two (the combine's range)."""
    cap = min(splits, max(1, PROGRAMS // (batch * kv_heads)), -(-max_length // block_n))
    return 1 << (max(cap, 1).bit_length() - 1)


def launch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           position: torch.Tensor, scale: float, block_n: int = BLOCK_N, splits: int = SPLITS,
           warps: int = WARPS) -> torch.Tensor:
    """The two kernels (the tests call this with CPU tensors under Triton's interpreter)."""
    from .decode_attention_kernel import decode_combine, decode_partial

    batch, heads, dim = q.shape
    kv_heads, max_length = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    padded = max(16, 1 << (group - 1).bit_length())
    splits = splits_for(batch, kv_heads, max_length, block_n, splits)
    m = torch.empty(batch * kv_heads, padded, splits, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(*m.shape, dim, device=q.device, dtype=torch.float32)
    decode_partial[(batch * kv_heads, splits)](
        q, key_cache, value_cache, position, m, l_sum, acc, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
        value_cache.stride(1), value_cache.stride(2), scale, max_length, KVH=kv_heads, G=group,
        GP=padded, D=dim, BLOCK_N=block_n, SPLITS=splits, DOT_F32=_interpreted(),
        num_warps=warps)
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype)
    decode_combine[(batch * heads,)](m, l_sum, acc, out, out.stride(0), out.stride(1),
                                     KVH=kv_heads, G=group, GP=padded, D=dim, SPLITS=splits,
                                     num_warps=4)
    return out


@torch.library.custom_op("unimax::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     position: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q K^T * scale) V over the entries 0..position of the caches, (B, H, D) in q's
    dtype: the split-KV kernels on CUDA, the twin elsewhere."""
    check_args(q, key_cache, value_cache, position)
    if not q.is_cuda:
        return decode_attention_ref(q, key_cache, value_cache, position, scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    return launch(q, key_cache, value_cache, position, scale)


@decode_attention.register_fake
def _(q, key_cache, value_cache, position, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
