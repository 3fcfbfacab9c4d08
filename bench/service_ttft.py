"""Time to first token as a chat user sees it: through the app's engine service (tokenizing, the
chat template, the engine thread, the kept conversation state), per mode, for a first message
and for a second message on the kept state. The figure is the service's own ``ttft_ms`` stat
(the panel's): from the request's start on the engine thread to its first token.

usage: python bench/service_ttft.py [--preset presets/demo.yaml] [--shape qwen3.5-0.8b]
       [--repeats 5] [--json FILE]

Every mode is warmed up first (graphs captured, as the app does at start-up), one at a time,
each mode's warm-up time printed as it ends: the app's start-up time on this machine, with
where it went (``startup_spent``: compiling, timing kernel choices, graph warm-ups and
captures; the parts overlap, see there). Median of
--repeats, each in a fresh conversation. Runs on the CPU too (the demo preset's model is
small), where the figures are the CPU's. ``--shape``: the preset served with random weights of
one of bench/shapes.py's hybrid Qwen3.5 shapes instead of its model, written by transformers
into a temporary folder (as bench/ttft.py writes them) beside the demo model's tokenizer (its
ids fit any of these vocabularies): TTFT at a real model's size through the whole service.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from unimax.modes import MODES  # noqa: E402
from unimax.presets import load_preset  # noqa: E402
from unimax.service import EngineService, GenerationSettings  # noqa: E402

FIRST = ("Explain what json.dumps does, what its indent and sort_keys arguments change, and "
         "when a caller should prefer json.dump instead.")
SECOND = "And json.loads?"


def ttft_ms(service, conversation: str, messages: list[dict], mode: str):
    """(TTFT ms, tokens prefilled, the reply's text) of one chat request."""
    handle = service.submit(conversation, messages, mode, GenerationSettings(max_new_tokens=4))
    for event in handle.events(timeout=600):
        if event.kind == "error":
            raise RuntimeError(f"{mode}: {event.text}")
        if event.kind == "done":
            stats = event.data["stats"]
            return float(stats["ttft_ms"]), int(stats["prefilled_tokens"]), event.data["reply"]
    raise RuntimeError(f"{mode}: the reply did not finish")


@contextlib.contextmanager
def random_model_folder(shape: str):
    """A folder holding random weights of ``shape`` (transformers' Qwen3_5ForCausalLM, saved as
    a user's download is) and the demo model's tokenizer files."""
    import torch
    from shapes import SHAPES
    from ttft import save_random_qwen

    demo = Path(__file__).resolve().parents[1] / "models" / "unimax-demo"
    with tempfile.TemporaryDirectory() as folder:
        save_random_qwen(SHAPES[shape], folder, "cuda" if torch.cuda.is_available() else "cpu")
        for name in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copy(demo / name, folder)
        yield folder


def startup_spent() -> dict:
    """What this process has spent so far on the parts of a warm-up: torch.compile (dynamo and
    inductor, its "_compile.compile_inner" time), the kernel choices' timing
    (ops.gemv.TIMING_SPENT) and graph captures (graph.CAPTURE_SPENT: their warm-up runs, which
    include first calls' compiles and choices, and the captures). Subtract two for a part."""
    from torch._dynamo.utils import compile_times

    from unimax.graph import CAPTURE_SPENT
    from unimax.ops.gemv import TIMING_SPENT

    names, seconds = compile_times(repr="csv", aggregate=True)
    compiled = dict(zip(names, map(float, seconds), strict=True))
    return {"compile_s": compiled.get("_compile.compile_inner", 0.0),
            "choice_keys": TIMING_SPENT["keys"], "choice_candidates": TIMING_SPENT["candidates"],
            "choice_s": TIMING_SPENT["seconds"], "graphs": CAPTURE_SPENT["graphs"],
            "graph_warm_up_s": CAPTURE_SPENT["warm_up_s"],
            "graph_capture_s": CAPTURE_SPENT["capture_s"]}


def spent_between(before: dict, after: dict) -> dict:
    return {key: round(after[key] - before[key], 2) for key in after}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="presets/demo.yaml")
    parser.add_argument("--shape", help="random weights of this bench/shapes.py hybrid shape")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    with contextlib.ExitStack() as stack:
        if args.shape:
            folder = stack.enter_context(random_model_folder(args.shape))
            preset = dataclasses.replace(preset, model=folder)
        rows = run(preset, args)
    label = args.preset + (f" with {args.shape}" if args.shape else "")
    for row in rows:
        row["preset"] = label
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{label}\n{'mode':<10}{'first msg ms':>14}{'(tokens)':>10}{'on kept ms':>12}"
          f"{'(tokens)':>10}{'warm-up s':>11}")
    for r in rows:
        print(f"{r['mode']:<10}{r['first_ms']:>14.2f}{r['first_tokens']:>10}"
              f"{r['second_ms']:>12.2f}{r['second_tokens']:>10}{r['warm_up_s']:>11.1f}")
    print(f"\nwarm-up parts, s\n{'mode':<10}{'compile':>9}{'choices':>9}{'(keys)':>8}"
          f"{'graphs':>8}{'warm-ups':>10}{'captures':>10}")
    for r in rows:
        p = r["warm_up_parts"]
        print(f"{r['mode']:<10}{p['compile_s']:>9.1f}{p['choice_s']:>9.1f}{p['choice_keys']:>8}"
              f"{p['graphs']:>8}{p['graph_warm_up_s']:>10.1f}{p['graph_capture_s']:>10.1f}")


def run(preset, args) -> list[dict]:
    start = time.perf_counter()
    service = EngineService(preset).start()
    print(json.dumps({"loaded_s": round(time.perf_counter() - start, 2)}), flush=True)
    try:
        warm_up_s, parts = {}, {}
        for mode in MODES:  # one at a time, each printed: a run cut short still says how far
            start, spent = time.perf_counter(), startup_spent()
            service.warm_up((mode,))
            warm_up_s[mode] = round(time.perf_counter() - start, 2)
            parts[mode] = spent_between(spent, startup_spent())  # where the warm-up went
            print(json.dumps({"mode": mode, "warm_up_s": warm_up_s[mode], **parts[mode]}),
                  flush=True)
        rows = []
        for mode in MODES:
            first, second, tokens = [], [], {}
            for i in range(args.repeats):
                conversation = f"ttft-{mode}-{i}"
                opening = [{"role": "user", "content": FIRST}]
                ms, tokens["first"], reply = ttft_ms(service, conversation, opening, mode)
                first.append(ms)
                # the conversation re-sent with one more turn, as the page and API clients do
                follow = [*opening, {"role": "assistant", "content": reply},
                          {"role": "user", "content": SECOND}]
                ms, tokens["second"], _ = ttft_ms(service, conversation, follow, mode)
                second.append(ms)
                service.store.forget(conversation)
            rows.append({"mode": mode,
                         "first_ms": statistics.median(first), "first_tokens": tokens["first"],
                         "second_ms": statistics.median(second),
                         "second_tokens": tokens["second"], "warm_up_s": warm_up_s[mode],
                         "warm_up_parts": parts[mode], "device": str(service.device)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        service.stop()
    return rows


if __name__ == "__main__":
    main()
