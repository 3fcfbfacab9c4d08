"""A few query tokens' attention over a static KV buffer, reading only the entries written so
far: ``decode_attention(q, key_cache, value_cache, position, scale) -> out``.

Why: a captured forward has fixed shapes, so torch's SDPA there reads the whole buffer (or the
graph's KV window) under a mask (keys at or below each query's position), whatever the
conversation's length. For one token on the H200 that cost 17.8 / 30.5 / 65.2 us per
attention layer at 4B heads for 2k / 8k / 32k buffers, against 7 us here at 512 stored entries
(bench/decode_attention.py); on an L4 the whole buffer's bytes are what
count: a Qwen3.5-4B preset's 8 attention layers over 8k-entry buffers read 268 MB a token
beside the weights' 8.4 GB, at 32k 1.07 GB. Every one-token step pays it: BF16-only, the FP8
draft's steps and the verifier's exact runs. The verifier's block (k drafts + 1 rows, causal
among themselves) ran ``attention.rows_attention`` over its graph's power-of-two window,
64 us per layer over 512 entries and 259 over 4k (fp32 form).

Here the position is read on the device, so one launch serves every step of a graph: the
key blocks below the last token's position + 1 are split over SPLITS programs per KV head
(each holding its KV head's query rows, token by head, as the rows of one tensor-core product,
up to ROWS a program), and a second launch combines the splits' partial softmaxes (flash
decoding). Off CUDA the op runs its twin, ``decode_attention_ref``: SDPA over the whole buffer
under the positions' mask, which is what the one-token graphs ran before. The field's
packaged form of the same thing (flash-attn's ``flash_attn_with_kvcache`` with device-side
sequence lengths) is a compiled CUDA package outside our dependencies; FlexAttention's
block-sparse decoding is not yet measured.

Shapes: q (B, H, D) for one token or (B, H, T, D) for T tokens at consecutive positions; the
caches (B, KVH, L, D) with H a multiple of KVH and D a power of two (16 or more), the same
dtype as q; position: the number of entries before the first token (a device integer tensor,
its first element read), the tokens' own entries already written. Token t sees the keys
0..position + t. The output has q's shape; for 4-D q its memory is (B, T, H, D), so that the
attention layer's transpose back to (B, T, H * D) is a view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemv import _interpreted

# Keys per block (one tensor-core product with the query rows) and programs per KV head.
# Chosen on the H200 by bench/decode_attention.py; SPLITS is capped so a
# batch's programs stay near one wave.
BLOCK_N = 32
SPLITS = 64
WARPS = 4
PROGRAMS = 128  # the SPLITS cap: about one H200 wave of programs for the whole batch
# Query rows (tokens x the query heads of a KV head) a program holds at most: its fp32
# accumulator is ROWS x D (64 x 256: 128 registers a thread at 4 warps); more rows take more
# programs, each reading the same keys (from L2 after the first).
ROWS = 64


def decode_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         position: torch.Tensor, scale: float) -> torch.Tensor:
    """The twin: SDPA over the whole buffer, each token's keys past its position masked."""
    one = q.dim() == 3
    q4 = q[:, :, None] if one else q
    keys = torch.arange(key_cache.shape[2], device=q.device)
    last = position.reshape(-1)[:1] + torch.arange(q4.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q4, key_cache, value_cache,
                                         attn_mask=keys[None, :] <= last[:, None], scale=scale,
                                         enable_gqa=q.shape[1] != key_cache.shape[1])
    return out[:, :, 0] if one else out


def check_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               position: torch.Tensor) -> None:
    batch, heads, dim = (q.shape[0], q.shape[1], q.shape[-1]) if q.dim() in (3, 4) else \
        (None,) * 3
    if q.dim() not in (3, 4) or key_cache.dim() != 4 or value_cache.shape != key_cache.shape \
            or key_cache.shape[0] != batch or key_cache.shape[3] != dim or \
            heads % key_cache.shape[1]:
        raise ValueError(f"decode_attention: q (B, H, D) or (B, H, T, D) and key/value caches "
                         f"(B, KVH, L, D) with H a multiple of KVH; got q {tuple(q.shape)}, "
                         f"keys {tuple(key_cache.shape)}, values {tuple(value_cache.shape)}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention: the caches must be in q's dtype ({q.dtype}); got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    if position.dtype not in (torch.int32, torch.int64) or position.numel() < 1:
        raise ValueError(f"decode_attention: position must be an integer tensor (the entries "
                         f"stored before the first token); got {position.dtype} "
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
    """SPLITS, fewer where the batch's KV heads (programs of rows) already fill PROGRAMS or
    the buffer has fewer blocks; a power of two (the combine's range)."""
    cap = min(splits, max(1, PROGRAMS // (batch * kv_heads)), -(-max_length // block_n))
    return 1 << (max(cap, 1).bit_length() - 1)


def row_tiles(tokens: int, group: int, rows: int = ROWS) -> tuple[int, int]:
    """(rows a program, programs a KV head) for ``tokens`` x ``group`` query rows: a power of
    two from 16 (the tensor cores' least) up to ``rows``."""
    needed = tokens * group
    per = min(max(16, 1 << (needed - 1).bit_length()), max(16, rows))
    return per, -(-needed // per)


def empty_out(q: torch.Tensor) -> torch.Tensor:
    """The output in q's shape; for (B, H, T, D) its memory is (B, T, H, D)."""
    if q.dim() == 3:
        return q.new_empty(q.shape)
    batch, heads, tokens, dim = q.shape
    return q.new_empty(batch, tokens, heads, dim).transpose(1, 2)


def launch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           position: torch.Tensor, scale: float, block_n: int = BLOCK_N, splits: int = SPLITS,
           warps: int = WARPS, rows: int = ROWS) -> torch.Tensor:
    """The two kernels (the tests call this with CPU tensors under Triton's interpreter)."""
    from .decode_attention_kernel import decode_combine, decode_partial

    out = empty_out(q)
    q4, out4 = (q[:, :, None], out[:, :, None]) if q.dim() == 3 else (q, out)
    batch, heads, tokens, dim = q4.shape
    kv_heads, max_length = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    per, tiles = row_tiles(tokens, group, rows)
    splits = splits_for(batch, kv_heads * tiles, max_length, block_n, splits)
    m = torch.empty(batch * kv_heads * tiles, per, splits, device=q.device,
                    dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(*m.shape, dim, device=q.device, dtype=torch.float32)
    decode_partial[(batch * kv_heads * tiles, splits)](
        q4, key_cache, value_cache, position, m, l_sum, acc, q4.stride(0), q4.stride(1),
        q4.stride(2), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), scale, max_length,
        KVH=kv_heads, G=group, T=tokens, RP=per, TILES=tiles, D=dim, BLOCK_N=block_n,
        SPLITS=splits, DOT_F32=_interpreted(), num_warps=warps)
    decode_combine[(batch * heads * tokens,)](
        m, l_sum, acc, out4, out4.stride(0), out4.stride(1), out4.stride(2), KVH=kv_heads,
        G=group, T=tokens, RP=per, TILES=tiles, D=dim, SPLITS=splits, num_warps=4)
    return out


@torch.library.custom_op("unimax::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     position: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q K^T * scale) V, token t over the entries 0..position + t of the caches, in
    q's shape and dtype: the split-KV kernels on CUDA, the twin elsewhere."""
    check_args(q, key_cache, value_cache, position)
    if not q.is_cuda:  # (in the layout the fake kernel promises: a compiled caller trusts it)
        return empty_out(q).copy_(decode_attention_ref(q, key_cache, value_cache, position,
                                                       scale))
    q = q if q.stride(-1) == 1 else q.contiguous()
    return launch(q, key_cache, value_cache, position, scale)


@decode_attention.register_fake
def _(q, key_cache, value_cache, position, scale):
    return empty_out(q)
