"""Time to first token as a chat user sees it: through the app's engine service (tokenizing, the
chat template, the engine thread, the kept conversation state), per mode, for a first message
and for a second message on the kept state. The figure is the service's own ``ttft_ms`` stat
(the panel's): from the request's start on the engine thread to its first token.

usage: python bench/service_ttft.py [--preset presets/demo.yaml] [--repeats 5] [--json FILE]

Every mode is warmed up first (graphs captured, as the app does at start-up). Median of
--repeats, each in a fresh conversation. Runs on the CPU too (the demo preset's model is
small), where the figures are the CPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unimax.modes import MODES  # noqa: E402
from unimax.presets import load_preset  # noqa: E402
from unimax.service import EngineService, GenerationSettings  # noqa: E402

FIRST = ("Explain what json.dumps does, what its indent and sort_keys arguments change, and "
         "when a caller should prefer json.dump instead.")
SECOND = "And json.loads?"


def ttft_ms(service, conversation: str, text: str, mode: str) -> tuple[float, int]:
    handle = service.submit(conversation, [{"role": "user", "content": text}], mode,
                            GenerationSettings(max_new_tokens=4))
    for event in handle.events(timeout=600):
        if event.kind == "error":
            raise RuntimeError(f"{mode}: {event.text}")
        if event.kind == "done":
            stats = event.data["stats"]
            return float(stats["ttft_ms"]), int(stats["prefilled_tokens"])
    raise RuntimeError(f"{mode}: the reply did not finish")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="presets/demo.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    service = EngineService(load_preset(args.preset)).start()
    try:
        service.warm_up()
        rows = []
        for mode in MODES:
            first, second, tokens = [], [], {}
            for i in range(args.repeats):
                conversation = f"ttft-{mode}-{i}"
                ms, tokens["first"] = ttft_ms(service, conversation, FIRST, mode)
                first.append(ms)
                ms, tokens["second"] = ttft_ms(service, conversation, SECOND, mode)
                second.append(ms)
                service.store.forget(conversation)
            rows.append({"preset": args.preset, "mode": mode,
                         "first_ms": statistics.median(first), "first_tokens": tokens["first"],
                         "second_ms": statistics.median(second),
                         "second_tokens": tokens["second"], "device": str(service.device)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        service.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{'mode':<10}{'first msg ms':>14}{'(tokens)':>10}{'on kept ms':>12}{'(tokens)':>10}")
    for r in rows:
        print(f"{r['mode']:<10}{r['first_ms']:>14.2f}{r['first_tokens']:>10}"
              f"{r['second_ms']:>12.2f}{r['second_tokens']:>10}")


if __name__ == "__main__":
    main()
