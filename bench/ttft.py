"""Time to first token (GPU): UNI MAX's exact prefill against transformers' own Qwen3.5 forward
(with fla's kernels, as transformers uses them when fla is installed), side by side in one run,
on the same random weights, at several prompt lengths; and a short prompt on kept state.

usage: python bench/ttft.py [--shapes qwen3.5-0.8b] [--lengths 128 512 4096 16384 65536]
       [--repeats 5] [--variants torch-norms chunk8k graphs512 ...] [--json FILE]

The weights are made by transformers (Qwen3_5ForCausalLM, random), saved, and loaded by
unimax.load_model, so both sides run the same numbers; the last position's logits are compared
in the same run (rel. error). UNI MAX's time is ``prefill_exact`` (prefill in chunks of
prefill_chunk, argmax, the bridge copy into the decoder): what a reply waits for. transformers'
is ``model(input_ids, use_cache=True, logits_to_keep=1)`` with a fresh cache (use_cache=False on
pure GDN shapes: its cache needs an attention layer, so it keeps no state there). "kept" rows: 128
new tokens on top of a kept state of 4096 (UNI MAX only), and the same with the state copied
out 8 tokens before the end (the service's checkpointed prefill under Qwen3.5's template).
Median of --repeats after two warm-ups. First row: both models' BF16 and ours in FP32 against
transformers in FP32 (512 tokens), the scale of BF16 rounding on these weights. --variants:
UNI MAX again per row with other settings
(``variant``: the torch forms of the norms, the chunk and graph buckets as they were before), in
the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402

import unimax  # noqa: E402
import unimax.norms  # noqa: E402
from unimax import build_engine  # noqa: E402
from unimax.cache import copy_cache_  # noqa: E402
from unimax.short_prefill import BUCKETS, ShortPrefill  # noqa: E402
from unimax.states import StateStore  # noqa: E402


def transformers_config(cfg):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types or ["linear_attention"] * cfg.num_hidden_layers),
        linear_num_key_heads=cfg.num_k_heads, linear_num_value_heads=cfg.num_v_heads,
        linear_key_head_dim=cfg.head_k_dim, linear_value_head_dim=cfg.head_v_dim,
        linear_conv_kernel_dim=cfg.conv_size, tie_word_embeddings=cfg.tie_word_embeddings,
        num_attention_heads=cfg.num_attention_heads or 8,
        num_key_value_heads=cfg.num_key_value_heads or 2, head_dim=cfg.attn_head_dim or 256,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta or 1e7,
                         "partial_rotary_factor": cfg.partial_rotary_factor or 0.25},
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=max(cfg.max_context or 0, 262144))


def measured(row: dict, side: str, fn, repeats: int):
    """``fn``'s median time and peak memory into ``row`` as ``{side}_ms``, ``{side}_peak_gib``
    (the allocator's peak over the timed calls, weights and caches included) and
    ``{side}_extra_gib`` (that peak over what was allocated before: the call's own memory,
    whatever earlier rows left), then one more call's result; on an error (out of memory, say)
    ``{side}_error`` and None."""
    try:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        row[f"{side}_ms"] = median_ms(fn, repeats)
        row[f"{side}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row[f"{side}_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
        return fn()
    except Exception as err:  # record, go on with the other side
        row[f"{side}_error"] = repr(err)[:200]
        torch.cuda.empty_cache()
        return None


def chunk_peaks(engine, ids: torch.Tensor) -> list[float]:
    """The allocator's peak (GiB) while each prefill chunk of ``ids`` ran, then what stayed
    allocated before the prefill: a peak that grows chunk by chunk would grow with the kept
    length. (It does not: 64k in a fresh process, 2026-12-01, four 16k chunks each at 4.74 GiB
    over 3.71 allocated before. That day's first 64k row, 47.9 GiB, came after the shorter
    rows and transformers' forwards in the same process, and its peak counted whatever they
    left allocated (what exactly was not pinned down): hence ``{side}_extra_gib`` in
    ``measured``, the call's own memory.)"""
    peaks = []

    def progress(done: int, total: int) -> bool:
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        return True

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    engine.prefill_exact(ids, on_progress=progress)
    return peaks + [before]


def largest_allocations(engine, ids: torch.Tensor, top: int = 8) -> list[str]:
    """The ``top`` largest allocations of one prefill of ``ids``, each with its size (GiB) and
    the innermost frames of unimax, fla or torch.nn that made it (the allocator's recorded
    history): what the long prompt's peak is made of."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        engine.prefill_exact(ids)
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocs = sorted((e for e in events if e["action"] == "alloc"), key=lambda e: -e["size"])
    out = []
    for event in allocs[:top]:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                  for f in event.get("frames", [])
                  if any(part in f["filename"] for part in ("unimax", "/fla/", "torch/nn"))]
        out.append(f"{event['size'] / 2**30:.2f} GiB at " + " < ".join(frames[:4]))
    return out


def median_ms(fn, repeats: int, before=None) -> float:
    times = []
    for i in range(repeats + 2):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def fp32_check(shape, ours, ours32, theirs, theirs32, gen, tokens: int = 512) -> dict:
    """How far BF16 is from FP32 on these random weights, for both sides, against
    transformers in FP32: the scale against which the BF16 rows' rel. error is read (a real
    mismatch shows as ours-fp32 far above ~1e-5)."""
    ids = torch.randint(0, ours.config.vocab_size, (1, tokens), device="cuda", generator=gen)
    with torch.inference_mode():
        ref = theirs32(input_ids=ids).logits[:, -1].float()
        got = {"ours_fp32": ours32(ids).logits[:, -1], "ours_bf16": ours(ids).logits[:, -1],
               "transformers_bf16": theirs(input_ids=ids).logits[:, -1]}
    return {"shape": shape, "fp32_check_tokens": tokens,
            **{f"{name}_rel_err": float((x.float() - ref).norm() / ref.norm())
               for name, x in got.items()}}


@contextlib.contextmanager
def variant(engine, name: str):
    """UNI MAX's prefill with the settings ``name`` names, joined by "+": "torch-norms" (the
    norms and SwiGLU as torch forms, not fla's fused kernels: the default before), "chunk8k"
    (prompts in chunks of 8192 tokens, the default before 16384), "graphs512" (the short
    prefill's graphs up to 512 tokens only, the buckets before 4096). Restored after."""
    saved = (engine.kernels, engine.prefill_chunk, engine.short_prefill)
    parts = name.split("+")
    unknown = set(parts) - {"torch-norms", "chunk8k", "graphs512"}
    if unknown:
        raise ValueError(f"unknown variant parts {sorted(unknown)}: torch-norms, chunk8k, "
                         "graphs512")
    # (the engine puts its kernel configuration in force for each of its calls)
    engine.kernels = engine.kernels.but(fla_prompt_kernels="torch-norms" not in parts)
    if "chunk8k" in parts:
        engine.prefill_chunk = 8192
    if engine.short_prefill is not None:
        # graphs of its own, captured with the variant's norms (the default ones keep theirs)
        engine.short_prefill = ShortPrefill(
            engine.exact_model, engine.exact_cache, use_graphs=True,
            buckets=tuple(b for b in BUCKETS if "graphs512" not in parts or b <= 512))
    try:
        yield
    finally:
        engine.kernels, engine.prefill_chunk, engine.short_prefill = saved


def kept_kv_kernels(cfg, new: int = 512, kept: int = 1024) -> dict:
    """Which of SDPA's fused kernels take a chunk's attention on kept KV (unimax.attention:
    ``causal_lower_right`` with grouped KV heads) at this shape's heads. Where neither does,
    torch materializes the mask and runs the math kernel: scores of (heads, new, kept + new)
    in memory, ~34 GB per layer for a 16k chunk on 48k kept at 0.8B, a candidate for the
    64k row's out of memory (2026-12-01)."""
    from torch.backends.cuda import (
        SDPAParams,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    heads, kv_heads, dim = (cfg.num_attention_heads or 8, cfg.num_key_value_heads or 2,
                            cfg.attn_head_dim or 256)
    q = torch.randn(1, heads, new, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, kept + new, dim, device="cuda", dtype=torch.bfloat16)
    out = {}
    for gqa in (True, False):
        kk = k if gqa else k.repeat_interleave(heads // kv_heads, dim=1)
        params = SDPAParams(q, kk, kk, None, 0.0, False, gqa)
        out[f"flash_gqa{int(gqa)}"] = bool(can_use_flash_attention(params, True))
        out[f"efficient_gqa{int(gqa)}"] = bool(can_use_efficient_attention(params, True))
    return out


def save_random_qwen(cfg, folder: str, device: str = "cuda") -> None:
    """Random BF16 weights of ``cfg`` made by transformers (Qwen3_5ForCausalLM, seed 0) and
    saved into ``folder`` as a user's download is."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        written = Qwen3_5ForCausalLM(transformers_config(cfg)).to(torch.bfloat16)
    written.save_pretrained(folder)


@contextlib.contextmanager
def random_model_folder(shape: str):
    """A folder holding random weights of ``shape`` (transformers' Qwen3_5ForCausalLM, saved as
    a user's download is) and the demo model's tokenizer files."""
    demo = Path(__file__).resolve().parents[1] / "models" / "unimax-demo"
    with tempfile.TemporaryDirectory() as folder:
        save_random_qwen(SHAPES[shape], folder, "cuda" if torch.cuda.is_available() else "cpu")
        for name in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copy(demo / name, folder)
        yield folder


def bench_shape(shape: str, lengths: list[int], repeats: int, variants: list[str] = ()
                ) -> list[dict]:
    from transformers import Qwen3_5ForCausalLM

    cfg = dataclasses.replace(SHAPES[shape], max_context=max(lengths) + 4096 + 256)
    with tempfile.TemporaryDirectory() as folder:
        save_random_qwen(cfg, folder)
        # Loaded back as a user loads it: a model cast with .to(bfloat16) keeps its RoPE
        # frequencies in BF16 too (from_pretrained keeps them FP32), which alone moved its
        # logits by ~5% at every length in the first runs of this bench.
        theirs = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
        theirs32 = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
        ours = unimax.load_model(folder, device="cuda", dtype="bfloat16",
                                 max_context=cfg.max_context)
        ours32 = unimax.load_model(folder, device="cuda", dtype="float32",
                                   max_context=cfg.max_context)
    engine = build_engine(ours, decode="bf16")
    # transformers' cache needs an attention layer (get_seq_length): pure GDN runs uncached
    cached = cfg.has_attention
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = [fp32_check(shape, ours, ours32, theirs, theirs32, gen)]
    if cfg.has_attention:
        rows[-1]["kept_kv_kernels"] = kept_kv_kernels(cfg)
    print(json.dumps(rows[-1]), flush=True)
    del ours32, theirs32
    for length in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda", generator=gen)
        row = {"shape": shape, "tokens": length}
        rows.append(row)
        # each side on its own: one running out of memory (one did at 64k on the H200,
        # 2026-12-01, unnamed) leaves the other's figures; the peaks say which and how far
        out = measured(row, "unimax", lambda ids=ids: engine.prefill_exact(ids)[1], repeats)
        if out is not None and length > engine.prefill_chunk:
            *row["unimax_chunk_peaks_gib"], row["unimax_base_gib"] = chunk_peaks(engine, ids)
        if out is not None and length >= engine.prefill_chunk:
            try:
                row["unimax_largest_allocations"] = largest_allocations(engine, ids)
            except Exception as err:  # (a private API of the allocator: record, go on)
                row["unimax_largest_allocations"] = [repr(err)[:200]]
        ref = measured(row, "transformers", lambda ids=ids: theirs(
            input_ids=ids, use_cache=cached, logits_to_keep=1), repeats)
        if ref is not None:
            ref = ref.logits[:, -1].float()
        if out is not None and ref is not None:
            row["speedup"] = row["transformers_ms"] / row["unimax_ms"]
            row["last_logits_rel_err"] = float((out.logits[:, -1].float() - ref).norm()
                                               / ref.norm())
        if ref is None:
            print(json.dumps(row), flush=True)
            continue
        for name in variants:
            try:
                with variant(engine, name):
                    rows[-1][f"{name}_ms"] = median_ms(
                        lambda ids=ids: engine.prefill_exact(ids), repeats)
                    _, out, _ = engine.prefill_exact(ids)
                rows[-1][f"{name}_err"] = float((out.logits[:, -1].float() - ref).norm()
                                                / ref.norm())
            except Exception as err:  # record, go on with the next variant
                rows[-1][f"{name}_error"] = repr(err)[:200]
        print(json.dumps(rows[-1]), flush=True)
    # 128 new tokens on a kept state of 4096
    ids = torch.randint(0, cfg.vocab_size, (1, 4096 + 128), device="cuda", generator=gen)
    engine.prefill_exact(ids[:, :4096])
    kept = engine.exact_cache.empty_like()
    copy_cache_(kept, engine.exact_cache)

    def restore():
        copy_cache_(engine.exact_cache, kept)

    def kept_ms():
        return median_ms(lambda: engine.prefill_exact(ids[:, 4096:], keep_state=True), repeats,
                         before=restore)

    rows.append({"shape": shape, "tokens": 128, "kept": 4096, "unimax_ms": kept_ms()})
    for name in variants:
        try:
            with variant(engine, name):
                rows[-1][f"{name}_ms"] = kept_ms()
        except Exception as err:  # record, go on with the next variant
            rows[-1][f"{name}_error"] = repr(err)[:200]
    print(json.dumps(rows[-1]), flush=True)
    # the same, with the state kept 8 tokens before the end (what the service does under
    # Qwen3.5's template: two prefills and a copy of the state into the kept-state store)
    store = StateStore(gpu_budget_bytes=1 << 40, host_budget_bytes=1 << 40)
    tokens = ids[0].tolist()

    def keep():
        store.save("bench", tokens[:4096 + 120], engine.exact_cache)

    rows.append({"shape": shape, "tokens": 128, "kept": 4096, "checkpoint": 120,
                 "unimax_ms": median_ms(lambda: engine._prefill(ids[:, 4096:], True, None,
                                                                (120, keep)),
                                        repeats, before=restore)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["qwen3.5-0.8b"], choices=list(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[128, 512, 4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=[],
                        help="also UNI MAX with these settings (see variant()), e.g. "
                             "torch-norms chunk8k graphs512")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        try:
            rows += bench_shape(shape, args.lengths, args.repeats, args.variants)
        except Exception as err:  # record, go on with the next shape
            rows.append({"shape": shape, "error": repr(err)[:400]})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print_table(rows, args.variants)


def print_table(rows: list[dict], variants: list[str]) -> None:
    print(f"\n{'shape':<14}{'tokens':>8}{'unimax ms':>11}{'transf. ms':>11}{'x':>7}{'err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<14} error {r['error'][:80]}")
        elif "fp32_check_tokens" in r:
            print(f"{r['shape']:<14}{r['fp32_check_tokens']:>8}   against transformers FP32: "
                  f"ours FP32 {r['ours_fp32_rel_err']:.1e}, ours BF16 "
                  f"{r['ours_bf16_rel_err']:.1e}, transformers BF16 "
                  f"{r['transformers_bf16_rel_err']:.1e}")
            if "kept_kv_kernels" in r:
                print(f"{'':<14}kernels for a chunk on kept KV: {r['kept_kv_kernels']}")
        elif "checkpoint" in r:
            print(f"{r['shape']:<14}{r['tokens']:>8}{r['unimax_ms']:>11.2f}"
                  f"   (on a kept state of {r['kept']}, state kept after {r['checkpoint']})")
        elif "kept" in r:
            also = "".join(f"   {name} {r[name + '_ms']:.2f}" if name + "_ms" in r
                           else f"   {name} error" for name in variants)
            print(f"{r['shape']:<14}{r['tokens']:>8}{r['unimax_ms']:>11.2f}"
                  f"   (on a kept state of {r['kept']}){also}")
        elif "speedup" not in r:
            print(f"{r['shape']:<14}{r['tokens']:>8}" + "".join(
                f"{r[side + '_ms']:>11.2f}" if side + "_ms" in r else f"{'error':>11}"
                for side in ("unimax", "transformers"))
                + "".join(f"   {side}: {r[side + '_error'][:60]}"
                          for side in ("unimax", "transformers") if side + "_error" in r)
                + (f"   unimax peak GiB {r['unimax_peak_gib']:.1f} (own "
                   f"{r['unimax_extra_gib']:.1f})" if "unimax_peak_gib" in r else ""))
        else:
            fla = "".join(f"   {name} {r[name + '_ms']:.2f} (err {r[name + '_err']:.1e})"
                          if name + "_ms" in r else f"   {name} error"
                          for name in variants)
            print(f"{r['shape']:<14}{r['tokens']:>8}{r['unimax_ms']:>11.2f}"
                  f"{r['transformers_ms']:>11.2f}{r['speedup']:>7.2f}"
                  f"{r['last_logits_rel_err']:>9.1e}{fla}   peak GiB "
                  f"{r['unimax_peak_gib']:.1f} / {r['transformers_peak_gib']:.1f} (own "
                  f"{r['unimax_extra_gib']:.1f} / {r['transformers_extra_gib']:.1f})")
        if "unimax_chunk_peaks_gib" in r:
            print(f"{'':<14}unimax peak GiB per prefill chunk: " + ", ".join(
                f"{peak:.1f}" for peak in r["unimax_chunk_peaks_gib"])
                + f" (allocated before the prefill: {r['unimax_base_gib']:.1f})")
        for line in r.get("unimax_largest_allocations", []):
            print(f"{'':<14}largest: {line[:150]}")


if __name__ == "__main__":
    main()
