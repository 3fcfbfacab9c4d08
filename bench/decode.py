"""Decode benchmark (GPU): every engine mode on two real shapes with random weights, batch 1,
512-token prompt, 256 new tokens, greedy; the baselines; the FP8 GEMV micro-benchmark.

usage: python bench/decode.py [--shapes gdn-1.3b gdn24-0.8b] [--new 256] [--compile]
       [--json FILE]
Prints a table last. The floor is weight bytes per token over the copy bandwidth measured in the
same run; "of floor" = floor time / measured time per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, decode_weight_bytes  # noqa: E402

import unimax  # noqa: E402
from unimax import GDNForCausalLM, build_engine  # noqa: E402
from unimax.cache import RecurrentCache  # noqa: E402
from unimax.fp8 import FP8Linear  # noqa: E402
from unimax.ops.gemv import gemv  # noqa: E402
from unimax.reference import first_divergence, float32_twin  # noqa: E402

VARIANTS = [  # bench rows: name, decode, draft, engine mode, FP8 kernel (None: the default)
    ("bf16", "bf16", "tail", "fast", None),
    ("fp8-tail", "fp8", "tail", "fast", None),
    ("fp8-tail/gemv", "fp8", "tail", "fast", "fp8_gemv"),
    ("verified-tail", "fp8", "tail", "verified", None),
    ("verified-full", "fp8", "full", "verified", None),
    ("verified-full/gemv", "fp8", "full", "verified", "fp8_gemv"),
]


TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its float32 twin


def judged_divergence(model, ids, tokens, reference) -> dict | None:
    """first_divergence with the float32 twin's verdict on the two tokens (the twin is made
    at a shape's first divergence, twice the model's bytes, and goes with the model)."""
    if tokens == reference[:len(tokens)]:
        return None
    if model not in TWINS:
        TWINS[model] = float32_twin(model)
    return first_divergence(model, ids, tokens, reference, twin=TWINS[model])


def median_device_seconds(fn, repeats: int, warmup: int = 0) -> float:
    """Median seconds of ``fn`` between two device events (the GPU's time, not the host's)."""
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_device_seconds(lambda: dst.copy_(src), 10, warmup=2)


def time_graph(fn, repeats: int = 20) -> float:
    """Median seconds per call of ``fn`` captured 20x in one CUDA graph (no launch gaps)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return median_device_seconds(graph.replay, repeats) / 20


@torch.inference_mode()
def fp8_gemv_rows(model) -> list[dict]:
    """M=1 on the tail's matrices and the first mixer's projections: BF16 through cuBLAS and
    through the Triton GEMV, and every FP8 mode (fp8_gemv the default; fp8_act, fp8_tensorwise:
    _scaled_mm; weight_only: dequantize, BF16 matmul), with each one's error against BF16."""
    rows = []
    last, mixer = model.layers[-1].mlp, model.layers[0].mixer
    for name, linear in (("lm_head", model.lm_head), ("mlp.gate_up", last.gate_up_proj),
                         ("mlp.down", last.down_proj), ("mixer.in_proj", mixer.in_proj),
                         ("mixer.out_proj", mixer.out_proj)):
        x = torch.randn(1, linear.in_features, device="cuda", dtype=torch.bfloat16)
        row = {"matrix": name, "shape": list(linear.weight.shape),
               "bf16_us": time_graph(lambda linear=linear, x=x: linear(x)) * 1e6,
               "bf16_gemv_us": time_graph(lambda linear=linear, x=x: gemv(x, linear.weight))
               * 1e6}
        for mode in ("fp8_act", "fp8_tensorwise", "fp8_gemv", "weight_only"):
            fp8 = FP8Linear(linear, mode=mode)
            row[f"{mode}_us"] = time_graph(lambda fp8=fp8, x=x: fp8(x)) * 1e6
            row[f"{mode}_rel_err"] = float((fp8(x).float() - linear(x).float()).norm()
                                           / linear(x).float().norm())
        row["speedup_fp8_act"] = row["bf16_us"] / row["fp8_act_us"]
        row["speedup_fp8_gemv"] = row["bf16_us"] / row["fp8_gemv_us"]
        rows.append(row)
    return rows


@torch.inference_mode()
def kernels_per_step(engine) -> dict:
    """Kernels and GPU-busy time of one decode step as the engine runs it (compiled or not),
    launched outside a graph."""
    from torch.profiler import ProfilerActivity, profile

    decoder = engine.decode_graph
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    decoder._step(token)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder._step(token)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_us = sum(getattr(e, "device_time", None) or e.cuda_time for e in events)
    return {"kernels": len(events), "gpu_busy_ms": busy_us / 1e3}


@torch.inference_mode()
def run_mode(model, name, decode, draft, mode, fp8_mode, ids, new, compile_step,
             reference) -> dict:
    engine = build_engine(model, decode=decode, draft=draft, block_size=8,
                          compile_step=compile_step, fp8_mode=fp8_mode)
    start = time.perf_counter()
    engine.generate(ids, 3 * 8 + 3, mode=mode)  # captures the block graphs (8 and 3)
    engine.generate(ids, new, mode=mode)  # and every replay length a verified run meets
    warmup_s = time.perf_counter() - start
    runs = [engine.generate(ids, new, mode=mode) for _ in range(2)]
    result = min(runs, key=lambda r: r.decode_seconds)
    steps = len(result.tokens) - 1
    row = {"mode": name + ("+compile" if compile_step else ""),
           "ttft_ms": (result.prefill_seconds + result.bridge.seconds) * 1e3,
           "prefill_tok_s": result.prefill_tokens / result.prefill_seconds,
           "decode_tok_s": steps / result.decode_seconds,
           "ms_per_token": result.decode_seconds / steps * 1e3,
           "bridge_ms": result.bridge.seconds * 1e3, "bridge_mib": result.bridge.mib,
           "finish_ms": result.finish_seconds * 1e3, "warmup_capture_s": warmup_s,
           "tokens_equal_exact": result.tokens == reference[: len(result.tokens)]}
    if not row["tokens_equal_exact"]:
        row["divergence"] = judged_divergence(model, ids, result.tokens, reference)
    if result.verify is not None:
        row.update(acceptance=result.verify.acceptance_rate,
                   rejected_blocks=result.verify.rejected_blocks,
                   verifier_blocks=result.verify.verifier_blocks)
    if mode == "fast":
        row.update(kernels_per_step(engine))
    row["weight_bytes"] = decode_weight_bytes(engine.decode_model)
    return row


@torch.inference_mode()
def eager_baseline(model, ids, n=32) -> dict:
    torch.cuda.synchronize()
    unimax.exact_greedy_tokens(model, ids, 4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    unimax.exact_greedy_tokens(model, ids, n)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"mode": "eager loop (ours)", "decode_tok_s": n / total, "ms_per_token": total / n * 1e3,
            "weight_bytes": decode_weight_bytes(model)}


def fla_generate_baseline(config, ids, n=64) -> dict:
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    fla_config = GatedDeltaNetConfig(
        hidden_size=config.hidden_size, num_heads=config.num_k_heads, head_dim=config.head_k_dim,
        expand_v=config.head_v_dim / config.head_k_dim, num_hidden_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size, intermediate_size=config.intermediate_size)
    model = GatedDeltaNetForCausalLM(fla_config).to("cuda", torch.bfloat16).eval()
    return time_generate(model, ids, n, "fla generate")


def time_generate(model, ids, n: int, name: str) -> dict:
    """A reference library's own greedy ``generate`` for n tokens, after a short warm-up."""
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"mode": name, "decode_tok_s": n / total, "ms_per_token": total / n * 1e3}


@torch.inference_mode()
def bridge_row(model, repeats: int = 50) -> dict:
    """The bridge alone: median of synchronized copies of the exact state into the decoder."""
    engine = build_engine(model, decode="bf16")
    engine.prefill_exact(torch.zeros(1, 16, dtype=torch.long, device="cuda"))
    times = [engine._bridge().seconds for _ in range(repeats)]
    device = median_device_seconds(engine.bridge_copy, repeats)  # the copies alone
    return {"mode": "bridge alone", "bridge_ms": statistics.median(times) * 1e3,
            "bridge_device_ms": device * 1e3,
            "bridge_mib": engine.last_bridge.mib}


PARTS = ("modes", "compile", "baselines", "gemv", "bridge", "kvwindow")


@torch.inference_mode()
def kv_window_rows(model, ids, new, reference) -> list[dict]:
    """Hybrid shapes: verified-tail with the verifier reading its KV bucket (the engine) and
    reading the whole buffer (buckets off), same run."""
    spec = next(m for m in VARIANTS if m[0] == "verified-tail")
    rows = []
    for label, floor in (("kv buckets", None), ("whole KV", 1 << 40)):
        saved = RecurrentCache.MIN_WINDOW
        if floor is not None:
            RecurrentCache.MIN_WINDOW = floor  # window_for then always gives the whole buffer
        try:
            row = run_mode(model, *spec, ids, new, False, reference)
        finally:
            RecurrentCache.MIN_WINDOW = saved
        row["mode"] = f"verified-tail, {label}"
        rows.append(row)
    return rows


def transformers_generate_baseline(config, ids, n=64) -> dict:
    """transformers' own Qwen3.5 (with fla's kernels when installed) on the hybrid shape: the
    anchor measured before this engine existed (13.7 tok/s on the H200)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_config = Qwen3_5TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        layer_types=list(config.layer_types), linear_num_key_heads=config.num_k_heads,
        linear_num_value_heads=config.num_v_heads, linear_key_head_dim=config.head_k_dim,
        linear_value_head_dim=config.head_v_dim, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.attn_head_dim,
        tie_word_embeddings=True)
    model = Qwen3_5ForCausalLM(hf_config).to("cuda", torch.bfloat16).eval()
    return time_generate(model, ids, n, "transformers generate")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["gdn-1.3b", "gdn24-0.8b", "qwen3.5-0.8b"],
                        choices=list(SHAPES))
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--parts", nargs="+", default=["modes", "baselines", "gemv", "bridge"],
                        choices=PARTS, help="what to run (compile: bf16 and fp8-tail steps "
                        "compiled by inductor, minutes of compile time)")
    parser.add_argument("--compile-shapes", nargs="+", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_GBps": bandwidth / 1e9}), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_GBps": bandwidth / 1e9, "shapes": {}}

    def emit(rows, row):
        if "ms_per_token" in row and "weight_bytes" in row:
            row["of_floor"] = row["weight_bytes"] / bandwidth / (row["ms_per_token"] / 1e3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for shape in args.shapes:
        config = SHAPES[shape]
        model = GDNForCausalLM.random(config, device="cuda", dtype=torch.bfloat16, seed=0)
        gen = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (1, 512), device="cuda", generator=gen)
        reference = unimax.exact_greedy_tokens(model, ids, args.new)[0].tolist()
        rows: list[dict] = []
        data = report["shapes"][shape] = {"rows": rows, "fp8_gemv": []}
        if "gemv" in args.parts:
            data["fp8_gemv"] = fp8_gemv_rows(model)
            print(json.dumps(data["fp8_gemv"]), flush=True)
        if "bridge" in args.parts:
            emit(rows, bridge_row(model))
        if "baselines" in args.parts:
            emit(rows, eager_baseline(model, ids))
            baseline = {"gdn-1.3b": ("fla generate", fla_generate_baseline),
                        "qwen3.5-0.8b": ("transformers generate",
                                         transformers_generate_baseline)}.get(shape)
            if baseline is not None:
                try:
                    emit(rows, baseline[1](config, ids))
                except Exception as err:
                    emit(rows, {"mode": baseline[0], "error": repr(err)[:300]})
        if "modes" in args.parts:
            for spec in VARIANTS:
                emit(rows, run_mode(model, *spec, ids, args.new, False, reference))
        if "kvwindow" in args.parts and config.layer_types and "full_attention" in \
                config.layer_types:
            for row in kv_window_rows(model, ids, args.new, reference):
                emit(rows, row)
        if "compile" in args.parts and shape in (args.compile_shapes or args.shapes):
            for spec in VARIANTS[:4]:  # bf16, fp8-tail (two FP8 kernels), verified-tail
                try:
                    emit(rows, run_mode(model, *spec, ids, args.new, True, reference))
                except Exception as err:  # record, keep benchmarking
                    emit(rows, {"mode": spec[0] + "+compile", "error": repr(err)[:300]})
        del model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for shape, data in report["shapes"].items():
        print(f"\n{shape}")
        print(f"{'mode':<22}{'tok/s':>8}{'ms/tok':>8}{'floor%':>7}{'ttft ms':>9}{'bridge ms':>10}"
              f"{'MiB':>6}{'accept':>7}{'kern':>6}{'busy ms':>8}{'exact':>6}")
        for r in data["rows"]:
            if "error" in r:
                print(f"{r['mode']:<22} error: {r['error'][:90]}")
                continue
            print(f"{r['mode']:<22}{r.get('decode_tok_s', 0):>8.0f}{r.get('ms_per_token', 0):>8.2f}"
                  f"{100 * r.get('of_floor', 0):>7.1f}{r.get('ttft_ms', 0):>9.1f}"
                  f"{r.get('bridge_ms', 0):>10.3f}{r.get('bridge_mib', 0):>6.1f}"
                  f"{r.get('acceptance', float('nan')):>7.2f}{r.get('kernels', 0):>6}"
                  f"{r.get('gpu_busy_ms', 0):>8.2f}{str(r.get('tokens_equal_exact', '')):>6}")
        for g in data["fp8_gemv"]:
            print(f"  GEMV {g['matrix']} {g['shape']}: bf16 {g['bf16_us']:.1f} us, bf16 "
                  f"Triton {g['bf16_gemv_us']:.1f} us, fp8_act "
                  f"{g['fp8_act_us']:.1f} us (x{g['speedup_fp8_act']:.2f}), fp8_tensorwise "
                  f"{g['fp8_tensorwise_us']:.1f} us, fp8_gemv {g['fp8_gemv_us']:.1f} us "
                  f"(x{g['speedup_fp8_gemv']:.2f}), weight_only {g['weight_only_us']:.1f} us")


if __name__ == "__main__":
    main()
