"""The draft-length policy (unimax.draft_length) against fixed draft lengths, simulated on the CPU
with a GPU run's measured costs: replies of N tokens whose drafts agree with probability a each
(independently), the policy starting from its prior every reply as the engine's does, each block
charged the captured graphs' replay times (bench/verified.py's ``policy_costs_ms``, written
only by a run without --fixed-only) plus a host cost. Throughput in BF16-only steps per token.

usage: python bench/draft_policy.py VERIFIED.json [--shape gdn-4b] [--new 128] [--replies 400]
       [--acceptance 0.5 0.8 0.9 0.95 0.97 0.99 1.0] [--decay 0.95 ...] [--prior 0.9 ...]
       [--persistent] [--switch 0.6 200]

Each block is charged its graphs' times plus the host cost, a k = 0 block a step of an exact
run (the engine runs them back to back, up to k_max in one graph, one host sync): charged
apart from the policy's own model, so that two policies are compared on the same costs. What
it leaves out: exact runs cut short by a probe or the reply's end, and that a real draft's
agreement is not independent from position to position. It is for tuning the policy, not a
speed figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unimax.draft_length import DraftLength  # noqa: E402


def simulate(costs: dict, a: float, new: int, replies: int, fixed: int | None = None,
             host_ms: float = 0.1, seed: int = 0, persistent: bool = False,
             switch: tuple[float, int] | None = None, **policy) -> tuple[float, float]:
    """Tokens per ms and blocks per reply: the policy (``fixed`` None) or every block drafting
    ``fixed`` (fewer where the reply ends first). ``persistent``: one policy for all replies
    (as the engine keeps it), not a fresh one per reply; ``switch`` (a2, every): the drafts'
    acceptance alternates between a and a2 every ``every`` tokens."""
    draft, verify = costs["draft"], costs["verify"]
    k_max = max(draft)
    rng = random.Random(seed)
    tokens = ms = blocks = 0
    p = None
    for _ in range(replies):
        if p is None or not persistent:
            p = DraftLength(k_max, host_ms=host_ms, **policy)
            p.calibrate(draft, verify, rewind_ms=costs.get("rewind", 0.0))
        left = new
        while left > 0:
            k = p.choose(left) if fixed is None else min(fixed, left - 1)
            rate = a if switch is None or (tokens // switch[1]) % 2 == 0 else switch[0]
            agreed = 0
            while agreed < k and rng.random() < rate:
                agreed += 1
            p.observe(k, agreed)
            emitted = min(agreed + 1, left)
            left -= emitted
            tokens += emitted
            blocks += 1
            # (charged as the engine runs it, whatever the policy's own model says: k = 0 as a
            # step of an exact run, which shares one host sync among up to k_max steps)
            run = min(k_max, p.probe_every)  # (an exact run's most steps)
            ms += (draft.get(k, 0.0) + verify[k] + (host_ms if k else host_ms / run)
                   + (costs.get("rewind", 0.0) if agreed < k else 0.0))
    return tokens / ms, blocks / replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--shape", default=None, help="the report's shape (default: its first)")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--replies", type=int, default=400)
    parser.add_argument("--acceptance", type=float, nargs="+",
                        default=[0.5, 0.8, 0.9, 0.95, 0.97, 0.99, 1.0])
    parser.add_argument("--decay", type=float, nargs="+", default=[DraftLength.decay])
    parser.add_argument("--prior", type=float, nargs="+", default=[DraftLength.prior])
    parser.add_argument("--persistent", action="store_true",
                        help="one policy across all replies (the engine's way), not one a reply")
    parser.add_argument("--switch", type=float, nargs=2, default=None, metavar=("A2", "EVERY"),
                        help="acceptance alternates between each row's a and A2 every EVERY "
                             "tokens (best fixed k then is one k for both)")
    args = parser.parse_args()
    mode = dict(persistent=args.persistent,
                switch=None if args.switch is None else (args.switch[0], int(args.switch[1])))
    shapes = json.loads(args.report.read_text())["shapes"]
    shape = args.shape or next(iter(shapes))
    parts = shapes[shape]["parts"]
    if "policy_costs_ms" not in parts:
        sys.exit(f"{args.report} has no policy_costs_ms for {shape}: run bench/verified.py "
                 "without --fixed-only (the adaptive rows calibrate the policy)")
    raw = parts["policy_costs_ms"]
    costs = {"draft": {int(k): v for k, v in raw["draft"].items() if int(k) > 0},
             "verify": {int(k): v for k, v in raw["verify"].items()},
             "rewind": raw.get("rewind", 0.0)}
    base = parts["bf16_step_ms"]
    k_max = max(costs["draft"])
    fixed = sorted({0, 1, 2, 4, 5, 6, 8, k_max} & set(range(k_max + 1)))
    print(f"{shape}: x BF16-only (step {base:.3f} ms), {args.new}-token replies, "
          f"{args.replies} each")
    print("acceptance " + " ".join(f"{'k=' + str(k):>7}" for k in fixed)
          + "".join(f"  policy(decay {d:g}, prior {p:g})" for d in args.decay
                    for p in args.prior))
    for a in args.acceptance:
        cells = [simulate(costs, a, args.new, args.replies, fixed=k, **mode)[0] * base
                 for k in fixed]
        line = f"{a:10.3f} " + " ".join(f"{c:7.3f}" for c in cells)
        for decay in args.decay:
            for prior in args.prior:
                rate, blocks = simulate(costs, a, args.new, args.replies, decay=decay,
                                        prior=prior, **mode)
                line += f"  {rate * base:7.3f} ({blocks:5.1f} blocks, x best fixed " \
                        f"{rate * base / max(cells):.3f})"
        print(line)


if __name__ == "__main__":
    main()
