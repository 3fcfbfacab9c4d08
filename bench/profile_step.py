"""Where a decode step's time goes (GPU): per variant, the graph-replay time per token of a
block of 8 and the kernels of one captured block, grouped by name.

usage: python bench/profile_step.py [--shapes gdn24-0.8b] [--variants graphs compile ...]
       [--json FILE]
Variants: graphs (plain captured steps, fla's recurrent kernel); fla, torch (the step compiled by
inductor with fla's recurrent kernel or the torch one); fla+gemv, torch+gemv (compiled, plain
linears through the Triton GEMV: unimax.fast_step; the BF16 fast step, its norms, gates and residual
adds folded into the GEMVs: the kernel configuration's fuse_bf16); draft (the full-FP8 draft of
verified mode as the engine builds it: every linear FP8, then fla+gemv); any of these with
"-unfused" (fla+gemv-unfused, draft-unfused): the GDN mixer's step as torch forms around fla's
recurrent kernel instead of one op (unimax.ops.decode_step); "-nofuse" (draft-nofuse,
fla+gemv-nofuse): without the norms, gates and residual adds folded into the GEMVs
(unimax.fused_draft, on by default; draft-unfused-nofuse: neither); engine-bf16, engine-draft,
engine-verify (the graphs the app replays, from ``build_engine(..., compile_step=True)`` after a
verified reply and ``capture_graphs``: the BF16 step, the full-FP8 draft step, and the verifier's
block of 8 drafts + 1, whose figures are per block, not per token, with the rollback inside); any
variant with "-combo" last (engine-verify-combo): the same with inductor's combo kernels, which
launch independent small kernels (the verify block's ~24 per layer: copies for the tape and the
recurrence, gates, norms) as one; "-pdl" before it (draft-pdl, engine-bf16-pdl): the fused GEMVs
with programmatic dependent launch (its pdl, off here by default), "-pdlend" with its signal at the
end of each program's K loop (pdl_trigger "end"); "-noconv" before those (draft-noconv): the GDN
in-projection without the convolution folded in (fold_conv, on by default: fla's conv kernel then
runs as a launch of its own); "-notma" before "-noconv" (draft-notma, fla+gemv-notma): the fused
GEMVs without their TMA forms offered (tma, on by default; the choices timed again without them);
"exact" (the verifier's view, unimax.verifier.exact_view, as one-token steps: what an exact run of k
= 0 blocks decodes, without the verifier's snapshot and resync), "exact-nobeta" (the same with
sigmoid(b) as a kernel of its own per layer, not in the in-projection's epilogue: fold_beta off);
"-blockrows" last before any "-combo" (engine-verify-blockrows): the verifier's blocks attending by
rows_attention over their KV bucket (decode_attention_tokens at 1) instead of through
ops.decode_attention. Random weights, batch 1; the state after a 64-token prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth, median_device_seconds  # noqa: E402
from shapes import SHAPES, decode_weight_bytes  # noqa: E402

from unimax import GDNForCausalLM  # noqa: E402
from unimax.fast_step import gemv_view  # noqa: E402
from unimax.fp8 import quantize_view, shallow_view  # noqa: E402
from unimax.graph import MaxTurboGraphDecoder  # noqa: E402

BLOCK = 8


def decoder_for(model, variant: str) -> MaxTurboGraphDecoder:
    if variant == "graphs":
        return MaxTurboGraphDecoder(model, block_size=BLOCK)
    if variant == "exact":
        from unimax.verifier import exact_view

        return MaxTurboGraphDecoder(exact_view(model), block_size=BLOCK, compile=True)
    variant, nofuse = variant.removesuffix("-nofuse"), variant.endswith("-nofuse")
    variant, unfused = variant.removesuffix("-unfused"), variant.endswith("-unfused")
    if variant == "draft":
        variant, model = "fla+gemv", quantize_view(model, "full")
    backend, _, gemv = variant.partition("+")
    view = gemv_view(model, fuse=not nofuse) if gemv == "gemv" else shallow_view(model)
    view.set_backend(backend)
    for block in view.layers if unfused else ():
        if hasattr(block.mixer, "decode_op"):  # the step's torch forms around fla's kernel
            block.mixer.decode_op = False
    return MaxTurboGraphDecoder(view, block_size=BLOCK, compile=True)


def cuda_events(replay) -> list:
    """The device events (kernels, copies) of one ``replay()`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type.name == "CUDA"]


def per_name(groups: dict[str, list[float]], per: int) -> list[dict]:
    """[{name, calls, us}] per ``per`` replayed steps, largest us first."""
    rows = [{"name": name, "calls": len(t) / per, "us": sum(t) / per}
            for name, t in groups.items()]
    return sorted(rows, key=lambda r: -r["us"])


def kernel_table(replay, per: int = BLOCK, events=None) -> tuple[list[dict], float, int]:
    """Kernels of one replay (or of its ``events``, cuda_events), grouped by name: [{name,
    calls, us}] per token (per ``per`` replayed steps), busy us, count."""
    groups: dict[str, list[float]] = defaultdict(list)
    for event in cuda_events(replay) if events is None else events:
        groups[event.name].append(getattr(event, "device_time", None) or event.cuda_time)
    rows = per_name(groups, per)
    return rows, sum(r["us"] for r in rows), sum(len(t) for t in groups.values()) / per


def kernel_gaps(events, per: int = BLOCK) -> tuple[list[dict], float]:
    """The idle time between a replay's kernels and copies (its ``events``, cuda_events),
    grouped by the kernel after the gap: [{name, calls, us}] per ``per`` replayed steps,
    largest first, and their total. (Traced under the profiler, which can stretch them: set
    against replay time - busy.)"""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    groups: dict[str, list[float]] = defaultdict(list)
    end = spans[0][0] if spans else 0.0
    for start, stop, name in spans:
        groups[name].append(max(0.0, start - end))
        end = max(end, stop)
    rows = per_name(groups, per)
    return rows, sum(r["us"] for r in rows)


def engine_graph(model, variant: str):
    """(the captured graph, steps it replays) of the engine the app builds."""
    import unimax

    decode = "bf16" if variant == "engine-bf16" else "fp8"
    engine = unimax.build_engine(model, decode=decode, draft="full", block_size=BLOCK,
                                 compile_step=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
    engine.generate(ids, 2 * BLOCK, mode="fast" if decode == "bf16" else "verified",
                    draft_block=None if decode == "bf16" else BLOCK)
    engine.capture_graphs(verified=decode != "bf16")
    if variant == "engine-verify":
        verifier = engine.verifier
        # the window the next block reads (a hybrid's KV bucket, or its whole buffer under
        # one_window; None: pure GDN), as Verifier.verify keys it
        seen = verifier.cache.seen_tokens
        span = verifier.span(BLOCK, seen)
        key = verifier.graph_key(BLOCK, span, verifier.window_for(seen + span), sampled=False)
        return verifier.runner.graphs[key], 1
    return engine.decode_graph.runner.graphs[(BLOCK, False)], BLOCK


def kernel_choices() -> dict[str, str]:
    """The per-shape kernel choices the engines made (plain and fused GEMVs and the verify
    block's SwiGLU-epilogue linears: form@tile or cuBLAS; the few-token recurrence per heads;
    the verifier's tape op per block-length bucket, and its in-projection with the tape in the
    epilogue where on), by shape: which kernels the measured figures ran."""
    from unimax.ops import (
        block_mixer,
        fused_gemv,
        gemv,
        gemv_swiglu,
        in_proj_tape,
        short_recurrence,
    )

    def dt(dtype) -> str:
        return str(dtype).removeprefix("torch.")

    plain = {f"M{m} {n}x{k} {dt(dtype)}": name
             for (m, n, k, dtype), name in gemv.CHOICES.items()}
    fused = {f"{pro}{'+res' if res else ''} M{m} {n}x{k} {dt(dtype)}":
             name for (pro, res, m, n, k, dtype), name in fused_gemv.CHOICES.items()}
    short = {f"recurrence {h}x{k} {hv}x{v} {dt(dtype)}{' from zeros' if zero else ''}": name
             for (h, k, hv, v, dtype, zero), name in short_recurrence.CHOICES.items()}
    tape = {f"tape T<={t} {h}x{k} {hv}x{v} {dt(dtype)}": name
            for (t, _, h, k, hv, v, dtype, _), name in block_mixer.CHOICES.items()}
    swiglu = {f"swiglu M{m} {n}x{k} {dt(dtype)}": name
              for (m, n, k, dtype), name in gemv_swiglu.CHOICES.items()}
    in_proj = {f"in_proj_tape M{m} {n}x{k} {dt(dtype)}": name
               for (m, k, n, _, dtype, _), name in in_proj_tape.CHOICES.items()}
    return {**plain, **fused, **short, **tape, **swiglu, **in_proj}


def choice_margins() -> dict[str, list]:
    """Every timed kernel choice's fastest two candidates in us (ops.gemv.TIMED_US, the raw
    keys of the choice tables): how close each choice was, for a form whose A/B kept the
    other kernel."""
    from unimax.ops.gemv import TIMED_US

    def dt(value) -> str:
        return str(value).removeprefix("torch.")

    return {" ".join(dt(part) for part in key):
            sorted(times.items(), key=lambda item: item[1])[:2]
            for key, times in TIMED_US.items()}


def profile_variant(model, variant: str, bandwidth: float) -> dict:
    """``variant`` as in the module docstring; with "-combo" last, everything it compiles is
    compiled with inductor's combo kernels (independent small kernels launched as one); with
    "-pdl" (before any "-combo"), its graphs are captured with the fused GEMVs launched with
    programmatic dependent launch (the kernel configuration's pdl); "-pdlend": the same with
    its pdl_trigger "end"."""
    import unimax.kernels as kernels
    import unimax.ops.fused_gemv as fused_gemv

    base = variant.removesuffix("-combo")
    combo = torch._inductor.config.patch(combo_kernels=base != variant)
    # "-blockrows": the verifier's blocks attend by rows_attention over their KV bucket, not
    # through ops.decode_attention (the one-token steps keep the op)
    block_tokens = 1 if base.endswith("-blockrows") else kernels.DEFAULT.decode_attention_tokens
    base = base.removesuffix("-blockrows")
    beta = not base.endswith("-nobeta")
    base = base.removesuffix("-nobeta")
    fold = not base.endswith("-noconv")
    base = base.removesuffix("-noconv")
    tma = not base.endswith("-notma")
    base = base.removesuffix("-notma")
    trigger = "end" if base.endswith("-pdlend") else "start"
    pdl = base.endswith(("-pdl", "-pdlend"))
    # the variant's kernel configuration, in force for what it builds and runs
    config = kernels.DEFAULT.but(pdl=pdl, pdl_trigger=trigger, fold_conv=fold, tma=tma,
                                 fold_beta=beta, decode_attention_tokens=block_tokens)
    choices = dict(fused_gemv.CHOICES)  # (the TMA variants' choices, timed again without)
    if not tma:
        for key in [key for key, name in choices.items() if name.startswith("tma")]:
            del fused_gemv.CHOICES[key]
    try:
        with combo, torch.inference_mode(), kernels.using(config):
            row = measure_variant(model, base.removesuffix("-pdlend").removesuffix("-pdl"),
                                  bandwidth)
        chosen = sorted(f"{key}: {name}" for key, name in kernel_choices().items())
    finally:
        if not tma:
            fused_gemv.CHOICES.clear()
            fused_gemv.CHOICES.update(choices)
    return {**row, "variant": variant, "gemv_choices": chosen}


def measure_variant(model, variant: str, bandwidth: float) -> dict:
    if variant.startswith("engine-"):
        graph, per = engine_graph(model, variant)
    else:
        decoder = decoder_for(model, variant)
        ids = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
        model.forward_unchecked(ids, decoder.cache)  # a real state to decode from
        decoder.capture_blocks()
        graph, per = decoder.runner.graphs[(BLOCK, False)], BLOCK
    seconds = median_device_seconds(graph.replay, 30, warmup=3) / per
    events = cuda_events(graph.replay)  # (one traced replay for both tables)
    rows, busy, count = kernel_table(graph.replay, per, events)
    gaps, idle = kernel_gaps(events, per)
    floor = decode_weight_bytes(model) / bandwidth
    return {"variant": variant, "us_per_token": seconds * 1e6, "busy_us": busy,
            "kernels": count, "of_floor": floor / seconds, "kernels_top": rows[:64],
            "traced_gap_us": idle, "gaps_top": gaps[:32]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["gdn24-0.8b"])
    parser.add_argument("--variants", nargs="+", default=["graphs", "fla", "fla+gemv"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    report = []
    for shape in args.shapes:
        model = GDNForCausalLM.random(SHAPES[shape], device="cuda", dtype=torch.bfloat16, seed=0)
        for variant in args.variants:
            try:
                row = {"shape": shape, **profile_variant(model, variant, bandwidth)}
            except Exception as err:  # record, keep profiling
                row = {"shape": shape, "variant": variant, "error": repr(err)[:300]}
            report.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for row in report:
        if "error" in row:
            print(f"{row['shape']} {row['variant']}: error {row['error'][:100]}")
            continue
        print(f"\n{row['shape']} {row['variant']}: {row['us_per_token']:.0f} us/token "
              f"({100 * row['of_floor']:.1f}% of floor), busy {row['busy_us']:.0f} us, "
              f"{row['kernels']:.0f} kernels/token")
        for k in row["kernels_top"][:18]:
            print(f"  {k['us']:7.1f} us {k['calls']:5.1f}x  {k['name'][:100]}")
        print(f"  gaps between kernels (traced): {row['traced_gap_us']:.0f} us; before:")
        for k in row["gaps_top"][:10]:
            print(f"  {k['us']:7.1f} us {k['calls']:5.1f}x  {k['name'][:100]}")
        if row.get("gemv_choices"):
            print("  GEMV choices: " + "; ".join(row["gemv_choices"]))


if __name__ == "__main__":
    main()
