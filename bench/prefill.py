"""Prefill throughput and fla-vs-torch error at the fla GDN 1.3B shape (GPU).

usage: python bench/prefill.py [--lengths 512 4096] [--repeats 5]
Random weights in the real shape (21 layers, hidden 2048, 6 heads x 256, expand_v 2, vocab 32000),
batch 1, BF16. Prefill is compute-bound: it reports achieved TFLOP/s (2 x params x tokens, plus
the chunked recurrence's own work, which is small at these sizes) next to tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shapes import GDN_1_3B as SHAPE_1_3B  # noqa: E402

from unimax import GDNForCausalLM  # noqa: E402
from unimax.ops.gated_delta import fla_ops  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.inference_mode()
def time_prefill(model, ids, repeats: int) -> float:
    cache = model.make_recurrent_cache()
    times = []
    for i in range(repeats + 2):  # two warm-ups: Triton autotuning, allocator growth
        cache.reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.forward_unchecked(ids, cache, logits_to_keep=1)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@torch.inference_mode()
def run_path(model, ids, step_ids, backend_prefill, backend_step):
    """Prefill, then one-token steps over the same fixed tokens (teacher-forced, so every path
    sees the same inputs); all logits and the final states."""
    model.set_backend(backend_prefill)
    cache = model.make_recurrent_cache()
    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=0).logits
    model.set_backend(backend_step)
    step_logits = []
    for t in range(step_ids.shape[1]):
        out = model(input_ids=step_ids[:, t:t + 1], past_key_values=cache, logits_to_keep=1)
        step_logits.append(out.logits)
    states = torch.stack([layer.recurrent_states[0] for layer in cache.layers])
    return logits.float(), torch.cat(step_logits, 1).float(), states


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if fla_ops() is None:
        raise SystemExit("flash-linear-attention is not importable here")

    model = GDNForCausalLM.random(SHAPE_1_3B, device="cuda", dtype=torch.bfloat16, seed=0)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows, errors = [], {}

    # Errors at 512 tokens: fla (BF16) and torch (BF16) against torch in FP32, same weights.
    ids = torch.randint(0, SHAPE_1_3B.vocab_size, (1, 512), device="cuda", generator=gen)
    step_ids = torch.randint(0, SHAPE_1_3B.vocab_size, (1, 16), device="cuda", generator=gen)
    fla = run_path(model, ids, step_ids, "auto", "auto")
    torch_bf16 = run_path(model, ids, step_ids, "chunk", "recurrent")
    model_fp32 = GDNForCausalLM.random(SHAPE_1_3B, device="cuda", dtype=torch.float32, seed=0)
    # same weights, FP32: copy the BF16 values so only the arithmetic differs
    with torch.no_grad():
        for p32, p16 in zip(model_fp32.parameters(), model.parameters(), strict=True):
            p32.copy_(p16.float())
    ref = run_path(model_fp32, ids, step_ids, "chunk", "recurrent")
    del model_fp32
    torch.cuda.empty_cache()
    for name, path in (("fla_bf16", fla), ("torch_bf16", torch_bf16)):
        errors[name] = {"prefill_logits": rel_err(path[0], ref[0]),
                        "step_logits": rel_err(path[1], ref[1]),
                        "final_states": rel_err(path[2], ref[2])}
    errors["fla_vs_torch_bf16_prefill_logits"] = rel_err(fla[0], torch_bf16[0])
    errors["fla_vs_torch_bf16_step_logits"] = rel_err(fla[1], torch_bf16[1])
    errors["fla_vs_torch_bf16_states"] = rel_err(fla[2], torch_bf16[2])

    for length in args.lengths:
        ids = torch.randint(0, SHAPE_1_3B.vocab_size, (1, length), device="cuda", generator=gen)
        for backend in ("auto", "chunk"):
            model.set_backend(backend)
            seconds = time_prefill(model, ids, args.repeats)
            tflops = 2 * params * length / seconds / 1e12
            rows.append({"tokens": length, "backend": "fla" if backend == "auto" else "torch",
                         "ms": seconds * 1e3, "tok_s": length / seconds, "tflops": tflops})

    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "params": params, "errors": errors, "rows": rows}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"errors": errors, "rows": rows}, indent=1))
    print(f"\n{'tokens':>7} {'kernel':>6} {'ms':>9} {'tok/s':>10} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['backend']:>6} {r['ms']:>9.2f} {r['tok_s']:>10.0f} "
              f"{r['tflops']:>8.1f}")
    print("errors vs FP32 torch:", {k: v for k, v in errors.items()})


if __name__ == "__main__":
    main()
