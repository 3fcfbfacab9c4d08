"""Decode speed of a reply held to a JSON schema, through the app's engine service, per mode,
side by side with the same mode's plain reply and with the exact model's eager per-token path
(what served every structured reply before the held steps' graphs; a request with logprobs still
runs there): decode tok/s, the service's own stat (the panel's).

usage: python bench/structured.py [--preset presets/demo.yaml] [--shape qwen3.5-0.8b]
       [--modes bf16 verified] [--repeats 3] [--tokens 96] [--json FILE]

Each mode is warmed up first as the app does (graphs captured, the held steps' forward and
choice among them), then one held reply (the grammar compiled); the figures are the medians of
--repeats fresh conversations. Held replies run through the graphs with the engine's defaults,
then with each switch off: ``held_ahead`` (each token's forward queued before the host reads
the token, unimax.held; off, "one at a time": the host's turn between the GPU's steps, the
plain loop) and in verified mode ``held_drafts`` (drafts under the
grammar, each block verified against its masks; off, "exact steps": one exact step a token,
as before), and ``held_host`` ("drafts unpriced": the draft-length policy without the host's
turns, unimax.held.HostTurns: it drafted where exact
steps were faster). Verified rows say how many tokens were drafted and what the held host
turns had learned (ms a draft / a step). Runs on the CPU too, where the figures are the CPU's.
``--shape``: the preset served with random weights of a bench/shapes.py hybrid shape (as
lab-benches:bench/service_ttft.py serves them): where a step is bandwidth-bound, as on an L4, the
per-token host work of a held reply (the grammar's mask, the sync) weighs less than on the
launch-bound demo model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import DOC_SCHEMA  # noqa: E402  (the structured-output tests' schema)
from unimax.held import HostTurns  # noqa: E402
from unimax.logprobs import LogprobsRequest  # noqa: E402
from unimax.presets import load_preset  # noqa: E402
from unimax.service import EngineService, GenerationSettings  # noqa: E402
from unimax.structured import response_format  # noqa: E402

QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "doc", "schema": DOC_SCHEMA}}


def reply(service, conversation: str, mode: str, tokens: int, held: bool, eager: bool) -> dict:
    handle = service.submit(conversation, QUESTION, mode, GenerationSettings(
        max_new_tokens=tokens), response_format=response_format(FORMAT) if held else None,
        logprobs=LogprobsRequest() if eager else None)
    done = list(handle.events(timeout=600))[-1]
    if done.kind != "done":
        raise SystemExit(f"{mode}: {done.text}")
    stats = done.data["stats"]
    return {"tok_s": stats["decode_tok_s"], "tokens": len(done.data["tokens"]),
            "served": stats["mode"], "reply": done.data["reply"],
            "drafted": stats.get("drafted_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="presets/demo.yaml")
    parser.add_argument("--shape", help="random weights of this bench/shapes.py hybrid shape")
    parser.add_argument("--modes", nargs="+", default=["bf16", "verified"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        preset = load_preset(args.preset)
        if args.shape:
            from ttft import random_model_folder

            preset = dataclasses.replace(
                preset, model=stack.enter_context(random_model_folder(args.shape)))
        rows = run(EngineService(preset).start(), args)
    print(f"\n{args.preset}" + (f" with {args.shape}" if args.shape else ""))
    print(f"{'mode':9} {'reply':26} {'tok/s':>9} {'x plain':>8}  {'served by':9} "
          f"{'drafted':>7}  host ms draft/step")
    for row in rows:
        plain = next(r for r in rows if r["mode"] == row["mode"] and r["reply"] == "plain")
        turns = row["host_turns"]
        print(f"{row['mode']:9} {row['reply']:26} {row['decode_tok_s']:9.1f} "
              f"{row['decode_tok_s'] / plain['decode_tok_s']:8.2f}  {row['served']:9} "
              f"{'' if row['drafted'] is None else row['drafted']:>7}  "
              + ("" if turns is None else f"{turns[0]:.3f} / {turns[1]:.3f}"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def variants(mode: str) -> list[tuple[str, bool, bool, bool, bool, bool]]:
    """Each row's (name, held to the schema, on the eager exact path, the engine's
    held_drafts, its held_ahead, its held_host learned): the defaults, then each switch
    off."""
    rows = [("plain", False, False, True, True, True),
            ("held, graphs", True, False, True, True, True)]
    if mode == "verified":  # (its default drafts under the grammar where they pay)
        rows += [("held, drafts unpriced", True, False, True, True, False),
                 ("held, exact steps", True, False, False, True, True),
                 ("held, steps one at a time", True, False, False, False, True)]
    else:
        rows += [("held, one at a time", True, False, True, False, True)]
    return rows + [("held, eager exact", True, True, True, True, True)]


def run(service, args) -> list[dict]:
    rows = []
    try:
        for mode in args.modes:
            service.warm_up((mode,))
            reply(service, "warm", mode, args.tokens, held=True, eager=False)
            engine = service.engines[mode]
            learned = engine.held_host
            for name, held, eager, drafts, ahead, priced in variants(mode):
                engine.held_drafts, engine.held_ahead = drafts, ahead
                engine.held_host = learned if priced else HostTurns(learn=False)
                runs = [reply(service, f"{mode}-{name}-{i}", mode, args.tokens, held, eager)
                        for i in range(args.repeats)]
                rate = statistics.median(r["tok_s"] for r in runs)
                turns = (engine.held_host.draft_ms, engine.held_host.step_ms) \
                    if mode == "verified" and held and not eager else None
                rows.append({"mode": mode, "reply": name, "decode_tok_s": rate,
                             "tokens": runs[0]["tokens"], "served": runs[0]["served"],
                             "drafted": runs[0]["drafted"], "host_turns": turns})
                print(f"{mode:9} {name:26} {rate:9.1f} tok/s  {runs[0]['tokens']:3} tokens  "
                      f"drafted {runs[0]['drafted']}  {runs[0]['reply'][:60]!r}", flush=True)
            engine.held_host = learned
    finally:
        service.stop()
    return rows


if __name__ == "__main__":
    main()
