"""One token's attention over a static KV buffer, GPU: unimax.ops.decode_attention (split-KV,
the length read on the device) against SDPA over the whole buffer under the position's mask
(what the graphs ran before: ``sdpa-mask``) and SDPA over exactly the stored entries (not
graph-safe: a lower bound for a one-kernel form, ``sdpa-exact``), graph-timed, at Qwen3.5-0.8B's
(8 heads, 2 KV heads of 256) and -4B's (16, 4) heads, several buffers and lengths, each of the
kernel's launch settings (BLOCK_N keys a block, SPLITS programs a KV head, warps).

``--blocks T ...``: the verifier's block of T tokens (k drafts + 1, causal among themselves)
the same way, against what its graphs ran before: ``rows_attention`` (attention.py) and SDPA
under the mask over the graph's power-of-two KV window (cache.window_for), at each kernel
setting of ROWS query rows a program.

Then ``--steps``: a hybrid shape's whole one-token forward (eager ops captured in one CUDA
graph, random weights, 512 tokens prefilled) with attention.DECODE_KERNEL on and off, at each
buffer: the step-level difference the kernel makes (the compiled fast step's attention is the
same op or the same SDPA call, so the difference carries over; its other kernels do not).

usage: python bench/decode_attention.py [--buffers 2048 8192 32768] [--blocks 9 17]
       [--steps qwen3.5-4b ...]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import median_device_seconds, time_graph  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax import GDNForCausalLM, attention  # noqa: E402
from unimax.cache import RecurrentCache  # noqa: E402
from unimax.ops import decode_attention as attn  # noqa: E402

SETTINGS = ((16, 16, 4), (16, 32, 4), (32, 16, 4), (32, 32, 4), (32, 64, 4), (64, 16, 8),
            (64, 32, 8))
# the attention layers' heads of the two hybrid shapes: (heads, KV heads, head size)
HEADS = {name: (SHAPES[shape].num_attention_heads, SHAPES[shape].num_key_value_heads,
                SHAPES[shape].attn_head_dim)
         for name, shape in (("0.8b", "qwen3.5-0.8b"), ("4b", "qwen3.5-4b"))}


@torch.inference_mode()
def kernel_rows(buffers: list[int]) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, kv_heads, dim) in HEADS.items():
        scale = dim ** -0.5
        for buffer in buffers:
            k = torch.randn(1, kv_heads, buffer, dim, device="cuda", generator=gen).bfloat16()
            v = torch.randn_like(k)
            q = torch.randn(1, heads, dim, device="cuda", generator=gen).bfloat16()
            for length in sorted({512, 4096, buffer} & set(range(1, buffer + 1))):
                position = torch.tensor([length - 1], device="cuda")
                ref = attn.decode_attention_ref(q, k, v, position, scale)
                row = {"heads": name, "buffer": buffer, "length": length,
                       "sdpa-mask_us": time_graph(partial(attn.decode_attention_ref, q, k, v,
                                                          position, scale)) * 1e6}
                exact_k, exact_v = k[:, :, :length], v[:, :, :length]
                row["sdpa-exact_us"] = time_graph(partial(
                    F.scaled_dot_product_attention, q[:, :, None], exact_k, exact_v,
                    scale=scale, enable_gqa=True)) * 1e6
                for block_n, splits, warps in SETTINGS:
                    out = attn.launch(q, k, v, position, scale, block_n, splits, warps)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    assert err < 1e-2, (name, buffer, length, block_n, splits, warps, err)
                    row[f"{block_n}x{splits}x{warps}_us"] = time_graph(partial(
                        attn.launch, q, k, v, position, scale, block_n, splits, warps)) * 1e6
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


# the block kernel's settings: (BLOCK_N, SPLITS, ROWS a program)
BLOCK_SETTINGS = ((32, 64, 16), (32, 64, 32), (32, 64, 64), (32, 32, 64), (16, 64, 64))


@torch.inference_mode()
def block_rows(buffers: list[int], tokens: list[int]) -> list[dict]:
    """The verifier's block of T tokens: the op at each BLOCK_SETTINGS against rows_attention
    and masked SDPA over the KV window a graph of it reads (the bucket holding the stored
    entries and the block), each checked against the twin."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (heads, kv_heads, dim) in HEADS.items():
        scale = dim ** -0.5
        for buffer in buffers:
            k = torch.randn(1, kv_heads, buffer, dim, device="cuda", generator=gen).bfloat16()
            v = torch.randn_like(k)
            for count in tokens:
                q = torch.randn(1, count, heads, dim, device="cuda",
                                generator=gen).bfloat16().transpose(1, 2)
                for stored in sorted({512, 4096} & set(range(1, buffer - count + 1))):
                    position = torch.tensor([stored], device="cuda")
                    window = RecurrentCache.bucket(stored + count, buffer)
                    last = stored + torch.arange(count, device="cuda")
                    mask = torch.arange(window, device="cuda")[None, :] <= last[:, None]
                    wk, wv = k[:, :, :window], v[:, :, :window]
                    ref = attn.decode_attention_ref(q, k, v, position, scale)
                    row = {"heads": name, "buffer": buffer, "tokens": count, "stored": stored,
                           "window": window,
                           "rows-window_us": time_graph(partial(
                               attention.rows_attention, q, wk, wv, mask, scale)) * 1e6,
                           "sdpa-window_us": time_graph(partial(
                               F.scaled_dot_product_attention, q, wk, wv, attn_mask=mask,
                               scale=scale, enable_gqa=True)) * 1e6}
                    err = float((attention.rows_attention(q, wk, wv, mask, scale).float()
                                 - ref.float()).norm() / ref.float().norm())
                    row["rows-window_err"] = err
                    for block_n, splits, per in BLOCK_SETTINGS:
                        call = partial(attn.launch, q, k, v, position, scale, block_n, splits,
                                       rows=per)
                        err = float((call().float() - ref.float()).norm() / ref.float().norm())
                        assert err < 1e-2, (name, buffer, count, stored, block_n, per, err)
                        row[f"{block_n}x{splits}r{per}_us"] = time_graph(call) * 1e6
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def step_rows(shapes: list[str], buffers: list[int], prompt: int = 512) -> list[dict]:
    rows = []
    for shape in shapes:
        for buffer in buffers:
            config = dataclasses.replace(SHAPES[shape], max_context=buffer)
            model = GDNForCausalLM.random(config, device="cuda", dtype=torch.bfloat16, seed=0)
            ids = torch.randint(0, config.vocab_size, (1, prompt + 1), device="cuda")
            row = {"shape": shape, "buffer": buffer, "prefilled": prompt}
            for kernel in (False, True):
                attention.DECODE_KERNEL = kernel
                cache = model.make_recurrent_cache()
                model(input_ids=ids[:, :prompt], past_key_values=cache)
                token = ids[:, prompt:]
                for _ in range(3):
                    model.forward_unchecked(token, cache)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.forward_unchecked(token, cache)
                cache.position.fill_(prompt)
                label = "kernel" if kernel else "sdpa-mask"
                row[f"{label}_ms"] = median_device_seconds(graph.replay, 50, warmup=5) * 1e3
                del graph, cache
            attention.DECODE_KERNEL = True
            row["saved_ms"] = row["sdpa-mask_ms"] - row["kernel_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffers", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--blocks", type=int, nargs="*", default=[],
                        help="the verifier's blocks of these many tokens too (e.g. 9 17)")
    parser.add_argument("--blocks-only", action="store_true",
                        help="with --blocks: no one-token rows")
    parser.add_argument("--steps", nargs="*", default=[], choices=["qwen3.5-0.8b", "qwen3.5-4b"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kernels = [] if args.blocks_only else kernel_rows(args.buffers)
    blocks = block_rows(args.buffers, args.blocks)
    steps = step_rows(args.steps, args.buffers)
    if args.json:
        args.json.write_text(json.dumps({"kernels": kernels, "blocks": blocks, "steps": steps},
                                        indent=1))
    if kernels:
        names = [f"{b}x{s}x{w}" for b, s, w in SETTINGS]
        print(f"\n{'heads':>5}{'buffer':>7}{'length':>7}{'mask':>7}{'exact':>7}"
              + "".join(f"{n:>10}" for n in names) + "   (us)")
    for r in kernels:
        print(f"{r['heads']:>5}{r['buffer']:>7}{r['length']:>7}{r['sdpa-mask_us']:>7.1f}"
              f"{r['sdpa-exact_us']:>7.1f}" + "".join(f"{r[n + '_us']:>10.1f}" for n in names))
    if blocks:
        names = [f"{b}x{s}r{r}" for b, s, r in BLOCK_SETTINGS]
        print(f"\n{'heads':>5}{'buffer':>7}{'T':>4}{'stored':>7}{'window':>7}{'rows':>8}"
              f"{'sdpa':>8}" + "".join(f"{n:>11}" for n in names) + "   (us)")
        for r in blocks:
            print(f"{r['heads']:>5}{r['buffer']:>7}{r['tokens']:>4}{r['stored']:>7}"
                  f"{r['window']:>7}{r['rows-window_us']:>8.1f}{r['sdpa-window_us']:>8.1f}"
                  + "".join(f"{r[n + '_us']:>11.1f}" for n in names))
    if steps:
        print(f"\n{'shape':>13}{'buffer':>7}{'sdpa-mask ms':>14}{'kernel ms':>11}{'saved ms':>10}")
        for r in steps:
            print(f"{r['shape']:>13}{r['buffer']:>7}{r['sdpa-mask_ms']:>14.3f}"
                  f"{r['kernel_ms']:>11.3f}{r['saved_ms']:>10.3f}")


if __name__ == "__main__":
    main()
