"""The verifier's rewind at a 4B model's GDN heads (32 layers as the batch, a 9-step span with
the steps past n masked, as a k = 8 block runs it), timed in CUDA graphs (GPU):

- steps: what ONE_PASS_REWIND=False runs: a snapshot of the states, the recurrence into a new
  state, its copy into the cache and the resync into the draft's cache;
- one pass: ops.short_recurrence.rewind_states_ (states read once, written three times, no
  outputs); and the same kernel with its outputs computed, to show what skipping them saves.

Each form graph-timed as the kernel choices are (unimax.ops.timing.graph_us: a few calls in
one captured graph, the median replay).

usage: python bench/rewind.py [--tile short@4x1x8]
Prints a table last: us per rewind and the states' bytes over that time.
"""

from __future__ import annotations

import argparse

import torch

from unimax.ops import short_recurrence as short
from unimax.ops.gated_delta import first_steps_only
from unimax.ops.timing import graph_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tile", default=None,
                        help="launch setting (default: the op's timed choice at these heads)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, heads, span = 32, (16, 128, 32, 128), 9  # (a tape's views: 18 rows, 9 used)
    q, k, v, g, beta, state = short.random_run(layers, span, heads, torch.bfloat16, gen, rows=18)
    saved, draft = torch.zeros_like(state), torch.zeros_like(state)
    length = torch.tensor(5, device="cuda")
    key = (*heads, torch.bfloat16, False)
    if args.tile:
        short.CHOICES[key] = args.tile
    short.short_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], state[:1], False)
    tile = short.parse(short.CHOICES[key])

    def steps():
        saved.copy_(state)
        gm, bm = first_steps_only(g, beta, length)
        _, new = short.short_gated_delta_rule(q, k, v, gm, bm, saved, True)
        state.copy_(new)
        draft.copy_(state)

    def one_pass(outputs: bool):
        gm, bm = first_steps_only(g, beta, length)
        short.launch_short(q, k, v, gm, bm, state, True, *tile, out=state, save=saved,
                           copy=draft, outputs=outputs)

    copy_us = graph_us(lambda _: draft.copy_(state), 1)
    rows = [("copy of the states (one)", copy_us, 2),
            ("steps (ONE_PASS_REWIND=False)", graph_us(lambda _: steps(), 1), 8),
            ("one pass, outputs computed", graph_us(lambda _: one_pass(True), 1), 4),
            ("one pass (rewind_states_)", graph_us(lambda _: one_pass(False), 1), 4)]
    nbytes = state.numel() * 4
    print(f"states {nbytes / 1e6:.0f} MB, tile {short.CHOICES[key]}")
    print(f"{'form':32} {'us':>8} {'GB/s':>7}")
    for name, us, passes in rows:
        print(f"{name:32} {us:8.1f} {passes * nbytes / us / 1e3:7.0f}")


if __name__ == "__main__":
    main()
