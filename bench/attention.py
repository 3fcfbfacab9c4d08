"""Decode-attention kernel choice (issue 6), GPU: one Qwen3.5-0.8B attention layer's attention
(8 query heads, 2 KV heads of 256, BF16) for a 1-token step, an 8-token verify block and a
128-token chat turn (the short prefill's graphs on kept state) over a static KV buffer,
graph-timed, at several filled lengths and buffer sizes.

Variants (all graph-capturable except where noted):
  full-mask   what unimax/attention.py does now: SDPA over the whole buffer, boolean mask from
              the device-side position. Reads max_context keys whatever the length.
  bucket      SDPA over the buffer's first `bucket` keys (next power of two >= length), same
              mask: one captured graph per bucket, chosen on the host, which knows the length.
  grouped     the query heads of each KV head folded into the query rows ((B, KVH, g*T, D)), so
              SDPA sees plain multi-query rows over one K/V head: no GQA expansion of the buffer
              (grouped_attention below), over the whole buffer, same mask. Measured slower:
              SDPA with a mask over several query rows is the slow case, not the expansion.
  grouped-bucket  both.
  rows        unimax.attention.rows_attention over the bucket: the grouped query rows as two
              matmuls on the tensor cores (BF16 in, fp32 out) and a softmax, no SDPA (T > 1
              only; the verifier's path when ROWS_ATTENTION_MAX >= T).
  rows-fp32   the same with fp32 matmuls (its form until 2026-12-01: cuBLAS's FFMA kernels).
  exact       SDPA over exactly `length` + T keys, no mask (so not causal inside a block): a
              lower bound, not graph-safe (the shape changes every step).

usage: python bench/attention.py [--max-context 4096 32768 131072] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import time_graph  # noqa: E402

from unimax.attention import rows_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 256


def grouped_attention(q, k, v, mask, scale):
    """q (B, H, T, D) over k, v (B, KVH, L, D): the g query heads of a KV head as g*T rows."""
    batch, heads, length, dim = q.shape
    group = heads // k.shape[1]
    rows = q.reshape(batch, k.shape[1], group * length, dim)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask.repeat(group, 1),
                                         scale=scale)
    return out.reshape(batch, heads, length, dim)


def attend(q, k, v, keys: int, position: torch.Tensor | None, grouped: bool = False,
           rows: str | None = None):
    """q (1, H, T, D) at positions position..position+T-1 over the first `keys` cache entries."""
    k, v = k[:, :, :keys], v[:, :, :keys]
    if position is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    queries = position + torch.arange(q.shape[2], device=q.device)
    mask = torch.arange(keys, device=q.device)[None, :] <= queries[:, None]
    if rows:  # "tc" or "fp32"
        return rows_attention(q, k, v, mask, q.shape[-1] ** -0.5, tensor_cores=rows == "tc")
    if grouped:
        return grouped_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@torch.inference_mode()
def rows(max_context: int) -> list[dict]:
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, KV_HEADS, max_context, DIM, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    v = torch.randn_like(k)
    for length in sorted({512, 4096, 32768, max_context} & set(range(1, max_context + 1))):
        for t in (1, 8, 128):
            if length + t > max_context:
                continue
            q = torch.randn(1, HEADS, t, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            position = torch.tensor(length, device="cuda")
            bucket = min(max_context, 1 << (length + t - 1).bit_length())
            row = {"max_context": max_context, "length": length, "tokens": t,
                   "kv_mib_at_length": 2 * length * KV_HEADS * DIM * 2 / 2**20}
            full = attend(q, k, v, max_context, position)
            for form, name in (("tc", "rows"), ("fp32", "rows-fp32")):
                if t == 1:  # rows_attention: the verifier's block (and, if it won, a prompt)
                    break
                got = attend(q, k, v, bucket, position, rows=form)
                assert torch.allclose(got.float(), full.float(), atol=2e-2), name
                row[f"{name}_us"] = time_graph(
                    lambda q=q, b=bucket, p=position, f=form: attend(q, k, v, b, p, rows=f)) * 1e6
            for name, keys, pos in (("full-mask", max_context, position),
                                    ("bucket", bucket, position), ("exact", length + t, None),
                                    ("grouped", max_context, position),
                                    ("grouped-bucket", bucket, position)):
                if name == "exact":  # causal within the block: the last query sees all keys
                    got = attend(q[:, :, -1:], k, v, keys, None)
                    assert torch.allclose(got.float(), full[:, :, -1:].float(), atol=2e-2)
                    row[f"{name}_us"] = time_graph(
                        lambda q=q, keys=keys: attend(q, k, v, keys, None)) * 1e6
                    continue
                grouped = name.startswith("grouped")
                got = attend(q, k, v, keys, pos, grouped)
                assert torch.allclose(got.float(), full.float(), atol=2e-2), name
                row[f"{name}_us"] = time_graph(
                    lambda q=q, keys=keys, pos=pos, g=grouped: attend(q, k, v, keys, pos, g)) * 1e6
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-context", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = [r for m in args.max_context for r in rows(m)]
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    print(f"\n{'max ctx':>8}{'length':>8}{'T':>3}{'full-mask us':>14}{'bucket us':>11}"
          f"{'exact us':>10}{'grouped us':>12}{'gr-bucket us':>14}{'rows us':>9}"
          f"{'rows-fp32 us':>14}")
    for r in table:
        print(f"{r['max_context']:>8}{r['length']:>8}{r['tokens']:>3}{r['full-mask_us']:>14.1f}"
              f"{r['bucket_us']:>11.1f}{r['exact_us']:>10.1f}{r['grouped_us']:>12.1f}"
              f"{r['grouped-bucket_us']:>14.1f}{r.get('rows_us', float('nan')):>9.1f}"
              f"{r.get('rows-fp32_us', float('nan')):>14.1f}")


if __name__ == "__main__":
    main()
