"""The verifier's rewind at a 4B model's GDN heads (32 layers as the batch, a 9-step span with
the steps past n masked, as a k = 8 block runs it), timed in CUDA graphs (GPU):

- steps: what ONE_PASS_REWIND=False runs: a snapshot of the states, the recurrence into a new
  state, its copy into the cache and the resync into the draft's cache;
- one pass: ops.short_recurrence.rewind_states_ (states read once, written three times, no
  outputs); and the same kernel with its outputs computed, to show what skipping them saves.

usage: python bench/rewind.py [--tile short@4x1x8]
Prints a table last: us per rewind and the states' bytes over that time.
"""

from __future__ import annotations

import argparse

import torch

from unimax.ops import short_recurrence as short
from unimax.ops.gated_delta import first_steps_only


def graph_us(body, replays: int = 50) -> float:
    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tile", default=None,
                        help="launch setting (default: the op's timed choice at these heads)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, heads, value_heads, dk, dv, span = 32, 16, 32, 128, 128, 9

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = (randn(layers, 18, heads, dk).bfloat16()[:, :span] for _ in range(2))
    v = randn(layers, 18, value_heads, dv).bfloat16()[:, :span]
    g = -torch.rand(layers, span, value_heads, device="cuda", generator=gen)
    beta = torch.rand(layers, span, value_heads, device="cuda", generator=gen).bfloat16()
    state = randn(layers, value_heads, dk, dv)
    saved, draft = torch.zeros_like(state), torch.zeros_like(state)
    length = torch.tensor(5, device="cuda")
    key = (heads, dk, value_heads, dv, torch.bfloat16, False)
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

    copy_us = graph_us(lambda: draft.copy_(state))
    rows = [("copy of the states (one)", copy_us, 2),
            ("steps (ONE_PASS_REWIND=False)", graph_us(steps), 8),
            ("one pass, outputs computed", graph_us(lambda: one_pass(True)), 4),
            ("one pass (rewind_states_)", graph_us(lambda: one_pass(False)), 4)]
    nbytes = state.numel() * 4
    print(f"states {nbytes / 1e6:.0f} MB, tile {short.CHOICES[key]}")
    print(f"{'form':32} {'us':>8} {'GB/s':>7}")
    for name, us, passes in rows:
        print(f"{name:32} {us:8.1f} {passes * nbytes / us / 1e3:7.0f}")


if __name__ == "__main__":
    main()
