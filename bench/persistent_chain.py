"""What a persistent step kernel could save (GPU): a draft step's chain of FP8 GEMVs as one
launch per GEMV against one launch for the whole chain, its phases separated by grid barriers.

What is left of issue 11 is fixed cost per kernel: every GEMV pays ~2.5-4.5 us of launch, DRAM
ramp and tail over its bytes' time (bench/small_reads.py, bench/gemv_parts.py), and a 4B draft
step runs 128 of them; every remedy inside one GEMV has lost (docs/design.md). The remedy left
is fewer kernels: a persistent kernel that runs a whole step, its programs meeting at a grid
barrier wherever one linear needs the last one's whole output. Before anyone builds that (a
multi-session project: the recurrence, norms and prologues inside it too), this bench asks
what its skeleton costs, with the same plain FP8 GEMV tile in every variant so that only the
boundaries differ:

- ``launch``: one launch per GEMV (grid: one program per output tile), captured in a graph, as
  the engine's steps run today; ``launchpdl``: each launch programmatic, the first W tile
  loaded before waiting for the launch before, as the engine's fused GEMVs do (sm_90);
- ``persistN``: one launch, N programs per SM, each phase's tiles grid-strided, an atomic
  counter barrier between phases (release after the stores, acquire polls before the loads);
- ``pollN``: the barrier polls the counter with volatile loads and acquires once after (no
  read-modify-write traffic at the counter while 132-528 programs wait);
- ``earlyN`` / ``pollearlyN``: each program loads its first weight tile of the next phase
  before it waits at the barrier (a linear's weights never depend on the last one's output:
  the one thing a persistent kernel can overlap that separate launches, even with PDL,
  overlap only in part);
- a suffix ``x2`` (``launchx2``, ``pollearly4x2``): the K loop keeps two weight tiles in flight
  (a persistent grid has few programs a SM to hide DRAM latency with);
- over 16 x 16 "empty" phases, ``launch`` / ``launchpdl`` / ``persist2`` / ``poll2``: a graph
  boundary's cost (plain and programmatic) and a grid barrier's, alone.

The chain is a model's decode GEMVs in order (in_proj, out_proj, gate_up, down per layer; each
reads the last one's first K outputs), FP8 e4m3 weights with a per-row scale, BF16 activations.
Every variant's outputs are checked bit for bit against the launched chain's (same tile, same
sums), and on the interpreter against torch (--dry). A grid barrier needs every program
resident at once: a variant asking more programs per SM than the compiled kernel's registers
allow is reported, not run, and a barrier that spins too long anyway sets a flag, and that
variant is not timed (thirty-fourth session: 4 a SM deadlocked, and timing it ran the call out).

Measured (H200, thirty-fourth session, bench/RESULTS.md): a kernel boundary in a graph costs
2.1 us, an atomic-polled grid barrier of 132 programs 3.1 us (with a flag atomic a barrier in
every program, since masked to stuck ones); the persistent chains ran 1.3x
(2 a SM) to 2.3x (1 a SM) slower than the launched ones, the early weight tile gaining ~1 us a
phase. Thirty-fifth session, with the flag masked: the barrier at 2 a SM 3.0 us (4.0 polling with
volatile loads), a graph boundary 2.1 us and a programmatic one 1.3; 2 a SM (all that fit)
1.26x slower than launched at 4B, ``x2`` no help; the direction is closed (docs/design.md).

usage: python bench/persistent_chain.py [--shapes gdn-4b gdn24-0.8b] [--json FILE]
       TRITON_INTERPRET=1 python bench/persistent_chain.py --dry
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unimax.ops.gemv_kernels import launch_dependents, wait_for_the_kernel_before  # noqa: E402

SPIN_LIMIT = 1 << 18  # polls before a barrier gives up (~60 ms on the H200: a deadlock, flagged)


@triton.jit
def _w_tile(w, w_off, N, K, t, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    return tl.load(w + w_off + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_tile(w, s, act, w_off, s_off, x_off, y_off, N, K, t, w0,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    """y[t's rows] = scale * (W[t's rows] @ x), W's first K tile given (``w0``), in fp32.
    AHEAD: each K tile's load is issued before the last tile's products (two in flight; plain
    loads are never pipelined by Triton), same sums in the same order."""
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(act + x_off + cols, mask=cols < K, other=0.0).to(tl.float32)
    if AHEAD:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        wt = w0
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ahead = _w_tile(w, w_off, N, K, t, k0, BLOCK_N, BLOCK_K)
            x_ahead = tl.load(act + x_off + k0 + cols, mask=k0 + cols < K, other=0.0)
            acc += wt.to(tl.float32) * x[None, :]
            wt, x = w_ahead, x_ahead.to(tl.float32)
        acc += wt.to(tl.float32) * x[None, :]
    else:
        acc = w0.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            wt = _w_tile(w, w_off, N, K, t, k0, BLOCK_N, BLOCK_K)
            x = tl.load(act + x_off + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            acc += wt.to(tl.float32) * x[None, :]
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    y = tl.sum(acc, axis=1) * tl.load(s + s_off + rows, mask=rows < N, other=0.0)
    tl.store(act + y_off + rows, y.to(tl.bfloat16), mask=rows < N)


@triton.jit
def _phase(table, p):
    """Phase p's row of the table: weight, scale, x and y offsets, N, K."""
    row = table + p * 6
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32))


@triton.jit
def chain_kernel(w, s, act, table, first, phases, counter, flag, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PERSIST: tl.constexpr, EARLY: tl.constexpr,
                 SPIN_LIMIT: tl.constexpr, POLL_LOAD: tl.constexpr = False,
                 AHEAD: tl.constexpr = False, PDL: tl.constexpr = False):
    """Phases first .. first + phases - 1 of the table. Launched (PERSIST off): one phase, a
    program per output tile. Persistent: every phase, tiles grid-strided over the programs, a
    grid barrier after each (the counter reaches programs x phases done)."""
    pid = tl.program_id(0)
    if PERSIST:
        nprog = tl.num_programs(0)
        w_off, s_off, x_off, y_off, N, K = _phase(table, first)
        w_next = _w_tile(w, w_off, N, K, pid, 0, BLOCK_N, BLOCK_K)
        for p in range(first, first + phases):
            w_off, s_off, x_off, y_off, N, K = _phase(table, p)
            if EARLY:
                w0 = w_next
            else:
                w0 = _w_tile(w, w_off, N, K, pid, 0, BLOCK_N, BLOCK_K)
            # the program's first tile (masked off where the phase has fewer tiles)
            _gemv_tile(w, s, act, w_off, s_off, x_off, y_off, N, K, pid, w0, BLOCK_N, BLOCK_K,
                       AHEAD)
            for t in range(pid + nprog, tl.cdiv(N, BLOCK_N), nprog):
                wt = _w_tile(w, w_off, N, K, t, 0, BLOCK_N, BLOCK_K)
                _gemv_tile(w, s, act, w_off, s_off, x_off, y_off, N, K, t, wt, BLOCK_N,
                           BLOCK_K, AHEAD)
            if EARLY:  # the next phase's first weight tile, before the wait (the last phase's
                # own again after the last one: a harmless reload)
                nw, ns, nx, ny, nN, nK = _phase(table, tl.minimum(p + 1, first + phases - 1))
                w_next = _w_tile(w, nw, nN, nK, pid, 0, BLOCK_N, BLOCK_K)
            # grid barrier: every thread's stores before the one arrival (release), the
            # acquire poll before any thread reads what other programs stored
            tl.debug_barrier()
            tl.atomic_add(counter, 1, sem="release", scope="gpu")
            target = nprog * (p - first + 1)
            if POLL_LOAD:  # poll with plain volatile loads (no read-modify-write contention
                # at the counter's L2 slice), then one acquire
                seen = tl.load(counter, volatile=True)
            else:
                seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            spins = tl.full((), 0, tl.int32)
            while (seen < target) & (spins < SPIN_LIMIT):
                if POLL_LOAD:
                    seen = tl.load(counter, volatile=True)
                else:
                    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                spins += 1
            if POLL_LOAD:
                tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            tl.atomic_max(flag, 1, mask=spins >= SPIN_LIMIT)  # (no traffic unless stuck)
            tl.debug_barrier()
    else:
        w_off, s_off, x_off, y_off, N, K = _phase(table, first)
        if PDL:  # as the engine's fused GEMVs: let the next launch start, load the first W
            # tile, then wait for the launch before (whose output is x)
            launch_dependents()
        w0 = _w_tile(w, w_off, N, K, pid, 0, BLOCK_N, BLOCK_K)
        if PDL:
            wait_for_the_kernel_before()
        _gemv_tile(w, s, act, w_off, s_off, x_off, y_off, N, K, pid, w0, BLOCK_N, BLOCK_K,
                   AHEAD)


def linears(cfg) -> list[tuple[int, int]]:
    """(N, K) of a GDN layer's decode GEMVs in order: in_proj, out_proj, gate_up, down."""
    from gemv import linear_shapes

    shapes = linear_shapes(cfg)
    return [shapes[name][:2] for name in ("in_proj", "out_proj", "gate_up", "down")]


class Chain:
    """A chain of FP8 GEMVs in three flat buffers (weights, scales, activations) and a phase
    table of offsets, so that one persistent launch can walk them."""

    def __init__(self, dims: list[tuple[int, int]], device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        table, w_off, s_off = [], 0, 0
        x_off, y_off = 0, dims[0][1]
        for n, k in dims:
            table.append([w_off, s_off, x_off, y_off, n, k])
            w_off, s_off = w_off + n * k, s_off + n
            # each output on its own 128-byte lines: a program that read the last output's
            # tail must not hold this one's head in its L1 from before it was written
            x_off, y_off = y_off, y_off + -(-n // 64) * 64
        self.dims, self.bytes = dims, w_off
        self.w = torch.empty(w_off, dtype=torch.float8_e4m3fn, device=device)
        self.s = torch.empty(s_off, dtype=torch.float32, device=device)
        for (n, k), (wo, so, *_) in zip(dims, table, strict=True):
            self.w[wo:wo + n * k] = torch.randn(n * k, generator=g, device=device).to(
                torch.float8_e4m3fn)
            self.s[so:so + n] = k ** -0.5
        self.act = torch.zeros(y_off, dtype=torch.bfloat16, device=device)
        self.act[:dims[0][1]] = torch.randn(dims[0][1], generator=g, device=device)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def outputs(self) -> torch.Tensor:
        return self.act[self.dims[0][1]:].clone()

    def launcher(self, variant: str, sms: int, tile: tuple[int, int, int]):
        bn, bk, warps = tile
        args = (self.w, self.s, self.act, self.table)
        meta = dict(BLOCK_N=bn, BLOCK_K=bk, SPIN_LIMIT=SPIN_LIMIT, num_warps=warps)
        flags = parse_variant(variant)
        if not flags["persist"]:
            grids = [(triton.cdiv(n, bn),) for n, _ in self.dims]
            pdl = {"PDL": True, "launch_pdl": True} if flags["pdl"] else {}

            def call():
                for p, grid in enumerate(grids):
                    chain_kernel[grid](*args, p, 1, self.counter, self.flag, PERSIST=False,
                                       EARLY=False, AHEAD=flags["ahead"], **pdl, **meta)
            return call

        def call():
            self.counter.zero_()
            chain_kernel[(flags["per_sm"] * sms,)](
                *args, 0, len(self.dims), self.counter, self.flag, PERSIST=True,
                EARLY=flags["early"], POLL_LOAD=flags["poll"], AHEAD=flags["ahead"], **meta)
        return call


def parse_variant(variant: str) -> dict:
    """launch[pdl][x2], or persistN / earlyN / pollN / pollearlyN [x2]: N programs a SM; pdl:
    each launch programmatic (compute capability 9+), as the engine's GEMVs; early: the
    next phase's first W tile loaded before the barrier; poll: the barrier polls with volatile
    loads; x2: each program's K loop keeps two W tiles in flight (AHEAD)."""
    m = re.fullmatch(r"(launch|launchpdl|persist|early|poll|pollearly)(\d*)(x2)?", variant)
    if m is None or m[1].startswith("launch") == bool(m[2]):
        raise SystemExit(f"unknown variant {variant!r}: launch[pdl][x2], or persistN, earlyN, "
                         "pollN, pollearlyN with N programs a SM, each with an optional x2")
    return {"persist": not m[1].startswith("launch"), "per_sm": int(m[2] or 0),
            "early": "early" in m[1], "poll": m[1].startswith("poll"), "ahead": bool(m[3]),
            "pdl": m[1] == "launchpdl"}


def per_sm_that_fit(chain: Chain, tile: tuple[int, int, int], flags: dict) -> int | None:
    """How many persistent programs of a variant an SM holds at once (registers, threads,
    shared memory of the compiled kernel), or None where this Triton does not say. A grid
    barrier needs every program resident: more per SM than this deadlocks (bench/RESULTS.md,
    thirty-fourth session: 4 a SM at 16 x 512 x 4 warps stuck)."""
    bn, bk, warps = tile
    try:
        kernel = chain_kernel.warmup(chain.w, chain.s, chain.act, chain.table, 0, 2,
                                     chain.counter, chain.flag, BLOCK_N=bn, BLOCK_K=bk,
                                     PERSIST=True, EARLY=flags["early"],
                                     POLL_LOAD=flags["poll"], AHEAD=flags["ahead"],
                                     SPIN_LIMIT=SPIN_LIMIT, num_warps=warps, grid=(1,))
        kernel._init_handles()
        regs, shared = kernel.n_regs, kernel.metadata.shared
    except Exception as err:  # (an API this Triton lacks: the stuck flag still guards)
        print(f"occupancy unknown: {err!r}", flush=True)
        return None
    props = torch.cuda.get_device_properties(0)
    reg_file = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    fit = min(reg_file // (per_warp * warps), threads // (32 * warps), 32)
    if shared:
        fit = min(fit, smem // (shared + 1024))  # (1 KB a block reserved by the driver)
    print(f"persistent kernel: {regs} registers a thread, {shared} B shared: {fit} a SM",
          flush=True)
    return fit


def reference(chain: Chain) -> torch.Tensor:
    """The chain in torch: each GEMV in fp32 over the BF16 input, rounded to BF16 as stored."""
    start = chain.dims[0][1]
    out = torch.zeros_like(chain.act[start:])
    x = chain.act[:start].float()
    for (n, k), (wo, so, _, yo, *_) in zip(chain.dims, chain.table.tolist(), strict=True):
        w = chain.w[wo:wo + n * k].float().view(n, k)
        y = ((w @ x[:k]) * chain.s[so:so + n]).to(torch.bfloat16)
        out[yo - start:yo - start + n] = y
        x = y.float()
    return out


def dry_run() -> None:
    """On the interpreter (programs run one after another, so persistent grids of 1 program):
    the launched and persistent chains equal torch's up to fp32 summation order, and each
    other bit for bit."""
    dims = [(40, 24), (24, 40), (56, 24), (24, 28)] * 2
    chain = Chain(dims, "cpu")
    want = reference(chain)
    got = {}
    for variant in ("launch", "launchx2", "persist1", "early1x2", "poll1", "pollearly1x2"):
        chain.act[dims[0][1]:] = 0
        chain.launcher(variant, sms=1, tile=(16, 16, 1))()
        got[variant] = chain.outputs()
        assert int(chain.flag) == 0, variant
        torch.testing.assert_close(got[variant].float(), want.float(), rtol=2e-2, atol=2e-2)
    assert all(torch.equal(got["launch"], g) for g in got.values())
    print("launched and persistent chains agree with torch and with each other")


def main() -> None:
    from decode import copy_bandwidth
    from shapes import SHAPES

    from unimax.ops.timing import graph_us

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["gdn-4b", "gdn24-0.8b"])
    parser.add_argument("--tile", default="16x512x4", help="BLOCK_N x BLOCK_K x warps")
    parser.add_argument("--variants", nargs="+",
                        default=["launch", "launchx2", "launchpdl", "persist2", "poll2",
                                 "pollearly2", "pollearly2x2", "pollearly3x2", "pollearly4x2"],
                        help="launch[pdl][x2], or persistN / earlyN / pollN / pollearlyN [x2] (N "
                             "programs a SM; poll: the barrier polls with loads; early: the next"
                             " W tile before it; x2: two W tiles in flight in the K loop)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    if args.dry:
        return dry_run()
    tile = tuple(int(v) for v in args.tile.split("x"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = copy_bandwidth() / 1e9  # (read + write counted, as bench/verified.py)
    rows = []
    for name in args.shapes:
        cfg = SHAPES[name]
        for label, dims in ((name, linears(cfg) * cfg.num_hidden_layers),
                            ("empty", [(16, 16)] * (4 * cfg.num_hidden_layers))):
            chain = Chain(dims, "cuda")
            want = None
            for variant in (args.variants if label != "empty"
                            else ["launch", "launchpdl", "persist2", "poll2"]):
                chain.act[dims[0][1]:] = 0
                chain.flag.zero_()
                row = {"shape": label if label != "empty" else f"{name} empty",
                       "variant": variant, "phases": len(dims), "bytes": chain.bytes,
                       "floor_us": chain.bytes / copy_gbps / 1e3}
                flags = parse_variant(variant)
                fits = per_sm_that_fit(chain, tile, flags) if flags["persist"] else None
                if fits is not None and flags["per_sm"] > fits:
                    # its programs cannot all be resident: the barrier would deadlock
                    row.update(us=float("nan"), same=False, stuck=1, fits_per_sm=fits)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                call = chain.launcher(variant, sms, tile)
                call()
                torch.cuda.synchronize()
                got = chain.outputs()
                want = got if want is None else want
                stuck = int(chain.flag)
                # a stuck barrier (the guard's spins: ~60 ms a phase) is not worth timing
                us = float("nan") if stuck else graph_us(lambda i, call=call: call(), 1)
                row.update(us=us, same=bool(torch.equal(got, want)), stuck=stuck)
                if label != "empty" and variant == "launch":
                    ref = reference(chain)
                    row["max_err_vs_torch"] = float((got.float() - ref.float()).abs().max())
                rows.append(row)
                print(json.dumps(row), flush=True)
            del chain
    if args.json:
        args.json.write_text(json.dumps({"copy_GBps": copy_gbps, "sms": sms, "tile": tile,
                                         "rows": rows}, indent=1))
    print(f"\n{sms} SMs, copy {copy_gbps:.0f} GB/s, tile {args.tile}; a chain's time, its share"
          " of the copy floor, and (us - floor) per phase")
    print(f"{'shape':18}{'variant':10}{'phases':>7}{'us':>10}{'floor%':>8}{'fixed/ph':>9}  ok")
    for r in rows:
        ok = ("yes" if r["same"] else "DIFFERS") + (" STUCK" if r["stuck"] else "")
        print(f"{r['shape']:18}{r['variant']:10}{r['phases']:7}{r['us']:10.1f}"
              f"{100 * r['floor_us'] / r['us']:8.1f}{(r['us'] - r['floor_us']) / r['phases']:9.2f}"
              f"  {ok}")


if __name__ == "__main__":
    main()
