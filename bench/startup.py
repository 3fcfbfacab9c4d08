"""Start-up as a user meets it: a fresh app process (the app's EngineService, its background
warm-up and kernel-choice cache, exactly as app.py starts them) on a cold cache folder, then
restarted on the same folder, with the CPU threads held to --threads (8: an L4 box's host).

Per run: seconds from the process's start to the model loaded, to the first reply's first token
in the preset's mode (sent at once, as a user would), to each mode ready and all of them; then
one conversation of --context tokens in each mode (decode tok/s of its reply, time to its first
token) and the peak GPU memory allocated and reserved, against an L4's 23.5 GB; then the
deferred kernel choices are timed and remembered for the next start (how long that took).

usage: python bench/startup.py [--preset presets/qwen3.5-4b-l4.yaml] [--shape qwen3.5-4b]
       [--threads 8] [--context 8192] [--runs cold restart] [--cache DIR] [--json FILE]
       [--memory-gb 22] [--dump-choices FILE]

--shape: the preset served with random weights of one of bench/shapes.py's hybrid Qwen3.5
shapes (written by transformers, with the demo model's tokenizer), instead of its own model.
--memory-gb: the process held to that much GPU memory (torch's per-process fraction), as an
L4 would hold it. --dump-choices: after the last run, the kernel choices its machine timed
(the disk cache), as unimax/ops/shipped/<arch>.json stores them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

FIRST = "Explain in three sentences how a recurrent language model differs from a transformer."
L4_GB = 23.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="presets/qwen3.5-4b-l4.yaml")
    parser.add_argument("--shape", help="random weights of this bench/shapes.py hybrid shape")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--runs", nargs="+", default=["cold", "restart"])
    parser.add_argument("--cache", type=Path, help="the cache folder (default: a new one)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--memory-gb", type=float)
    parser.add_argument("--dump-choices", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # (a run's process: its model)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    with contextlib.ExitStack() as stack:
        model = None
        if args.shape:
            from ttft import random_model_folder

            model = stack.enter_context(random_model_folder(args.shape))
        cache = args.cache or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for run in args.runs:
            rows.append({"run": run, **spawn(args, model, cache)})
            print(json.dumps(rows[-1]), flush=True)
        if args.dump_choices:
            files = sorted((cache / "choices").glob("*.json"))
            tables = json.loads(files[-1].read_text())["tables"] if files else {}
            args.dump_choices.write_text(json.dumps({"tables": tables}, indent=1,
                                                    sort_keys=True) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    table(rows, args)


def spawn(args, model: str | None, cache: Path) -> dict:
    """One app process on ``cache``, its CPUs held to ``args.threads``: its events, timed from
    its spawn."""
    cmd = [sys.executable, __file__, "--child", model or "-", "--preset", args.preset,
           "--context", str(args.context), "--threads", str(args.threads)]
    if args.memory_gb:
        cmd += ["--memory-gb", str(args.memory_gb)]
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    env = {**os.environ, "UNIMAX_CACHE": str(cache), "OMP_NUM_THREADS": str(args.threads)}
    start = time.time()
    proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, cpus)), *cmd], env=env,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    events: dict = {}
    for line in proc.stdout:
        if not line.startswith("@@"):
            print(line, end="", flush=True)
            continue
        event = json.loads(line[2:])
        event["s"] = round(event.pop("at") - start, 2)
        print(json.dumps(event), flush=True)
        name = event.pop("event")
        events[name if name not in ("ready", "context") else f"{name}-{event['mode']}"] = event
    proc.wait()
    events["returncode"] = proc.returncode
    return events


def emit(event: str, **data) -> None:
    print("@@" + json.dumps({"event": event, "at": time.time(), **data}), flush=True)


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from unimax.ops import choices
    from unimax.ops.choices import use_cache_folder
    from unimax.presets import load_preset
    from unimax.service import EngineService, GenerationSettings

    use_cache_folder()
    preset = load_preset(args.preset)
    if args.child != "-":
        preset = dataclasses.replace(preset, model=args.child, examples=())
    if args.memory_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 2**30 / total))
    emit("python")
    service = EngineService(preset).start()
    emit("loaded", plan_gb={part.name: round(part.bytes / 1e9, 3)
                            for part in service.memory_plan})
    all_ready = threading.Event()
    warm = service.warm_up_in_background(on_ready=lambda mode, _: emit("ready", mode=mode),
                                         on_done=lambda s, err: (emit("all_ready", error=err),
                                                                 all_ready.set()))
    handle = service.submit("first", [{"role": "user", "content": FIRST}], preset.mode,
                            GenerationSettings(max_new_tokens=32))
    first = True
    for event in handle.events(timeout=1800):
        if event.kind == "delta" and first:
            first = False
            emit("first_token", mode=preset.mode)
        if event.kind in ("done", "error"):
            emit("first_reply", kind=event.kind, text=event.text[:200])
    all_ready.wait(3600)
    if torch.cuda.is_available():
        emit("memory_warm", said=service.memory_said(after_warm_up=True), **memory())
    vocab = service.model.config.vocab_size
    for mode in ("bf16", "fp8", "verified"):
        new = 128
        prompt = torch.randint(0, min(vocab, 32000), (args.context - new - 8,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        events = list(service.submit(f"context-{mode}", [], mode,
                                     GenerationSettings(max_new_tokens=new),
                                     tokens=prompt).events(timeout=1800))
        done = events[-1]
        stats = done.data.get("stats", {}) if done.kind == "done" else {}
        emit("context", mode=mode, kind=done.kind, error=done.text[:200] if done.kind == "error"
             else None, tokens=len(prompt), decode_tok_s=stats.get("decode_tok_s"),
             ttft_ms=stats.get("ttft_ms"), generated=stats.get("generated_tokens"),
             acceptance=stats.get("acceptance_rate"),
             **(memory() if torch.cuda.is_available() else {}))
        service.store.forget(f"context-{mode}")
    start = time.perf_counter()
    warm.join(3600)  # (the deferred kernel choices, timed after the warm-up)
    emit("tuned", seconds=round(time.perf_counter() - start, 2), **choices.REMEMBERED)
    service.stop()


def memory() -> dict:
    import torch

    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2)}


def table(rows: list[dict], args) -> None:
    print(f"\n{args.preset}{' with ' + args.shape if args.shape else ''}, {args.threads} CPU "
          f"threads, s from the process's start")
    print(f"{'run':<9}{'loaded':>8}{'1st token':>10}" + "".join(
        f"{m + ' ready':>15}" for m in ("bf16", "fp8", "verified")) + f"{'all':>8}"
          f"{'tuned s':>9}{'peak GB':>9}")

    def s(row, key):
        return f"{row[key]['s']:.1f}" if key in row else "-"

    for row in rows:
        peak = max((row[k].get("peak_allocated_gb", 0) for k in row if k.startswith("context")),
                   default=0)
        tuned = f"{row['tuned']['seconds']:.1f}" if "tuned" in row else "-"
        print(f"{row['run']:<9}{s(row, 'loaded'):>8}{s(row, 'first_token'):>10}" + "".join(
            f"{s(row, 'ready-' + m):>15}" for m in ("bf16", "fp8", "verified")) +
              f"{s(row, 'all_ready'):>8}{tuned:>9}{peak:>9.2f}")
    print(f"\n{args.context}-token conversation per mode: decode tok/s (peak allocated GB, "
          f"of an L4's {L4_GB})")
    for row in rows:
        cells = []
        for m in ("bf16", "fp8", "verified"):
            c = row.get(f"context-{m}", {})
            cells.append(f"{m} {c.get('decode_tok_s')} ({c.get('peak_allocated_gb')})")
        print(f"{row['run']:<9}" + ", ".join(cells))


if __name__ == "__main__":
    main()
