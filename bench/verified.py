"""Verified mode against BF16-only, side by side in one run (GPU): the speed of exact greedy
decoding with FP8 drafts, at the draft's real acceptance and at forced acceptance rates, and
where a verified block's time goes.

usage: python bench/verified.py [--shapes gdn-4b qwen3.5-4b gdn24-0.8b] [--new 256]
       [--acceptance 1.0 0.95 0.9 0.8] [--block 8] [--draft full] [--ab-draft int4]
       [--temperature 0.7]
       [--fixed-only] [--seeds 4] [--ab-rewind]
       [--ab-short-tile short@4x1x8] [--ab-swiglu] [--ab-beta]
       [--ab-tape-apart] [--ab-span-4] [--probe-every 64 128] [--kernels]
       [--json FILE]

Both engines run the fast step (compile_step=True). Random weights give flat logits whose top two
are often within rounding of each other, so two correct BF16 computations soon part ways and no
fixed reference predicts the verifier's stream. The bench therefore peaks the LM head: 64 rows
scaled by 4 (same bytes, same work per token), so the greedy stream has clear margins. Forced
acceptance: the draft block runs as always (same work), then its tokens are replaced on the
device by the exact greedy reference, each position independently corrupted with probability
1 - rate; the verifier then accepts or rejects exactly as it would a real draft. A rate below
1.0 runs --seeds corruption patterns, pooled into its row (one 128-token pattern is a few
rejections, and where they fall moves the row by ~10%). Per-part times
are CUDA-graph replays of the engine's own graphs: a BF16 step, a draft step, the verifier's
forward over k + 1 tokens (the rollback included), a rewind alone. Rows at a fixed k (--block),
then, after every graph is captured and timed (which calibrates unimax.draft_length), the same
rows with the draft length chosen per block ("adaptive": the app's default; "mean k" per block).
Prints a table last; "floor%" is the weight bytes over the copy bandwidth; "exact" says where a
reply left the one-token reference and whether that was a near tie.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth, judged_divergence, median_device_seconds  # noqa: E402
from profile_step import choice_margins, kernel_choices, kernel_table  # noqa: E402
from shapes import SHAPES, decode_weight_bytes  # noqa: E402

import unimax  # noqa: E402
import unimax.kernels  # noqa: E402
from unimax import GDNForCausalLM, build_engine  # noqa: E402
from unimax.modes import DRAFTS  # noqa: E402
from unimax.ops.pdl import pdl_label  # noqa: E402
from unimax.reference import is_near_tie  # noqa: E402

STARTED = time.perf_counter()
PROMPT = 512  # tokens of every row's prompt (random ids)


@dataclass(frozen=True)
class SwitchAB:
    """An A/B option: a second verified engine built with the run's kernel configuration
    (unimax.kernels) but ``changes`` (with_switch), its rows and parts labelled ``label``;
    ``verify``: its verify block timed too; ``exact``: its exact step and exact run
    (exact_parts)."""
    flag: str
    changes: dict
    label: str
    help: str
    verify: bool = False
    exact: bool = False


SWITCH_ABS = (
    SwitchAB("--ab-pdl-fp8", {"pdl": "fp8"}, "pdl_fp8",
             "also a second verified engine with PDL for FP8 weights only (the draft's "
             "GEMVs; the verifier's and BF16-only's stay plain), its forced rows and draft "
             "step beside the first's (whose PDL is --pdl's: auto by default; --pdl off for "
             "plain against PDL)"),
    SwitchAB("--ab-rewind", {"one_pass_rewind": False}, "rewind_in_steps",
             "also a verified engine whose rewind runs as a snapshot, a recurrence and copies "
             "(one_pass_rewind off: the states read and written three more "
             "times): its forced rows and verify block beside the one-pass rewind's",
             verify=True),
    SwitchAB("--ab-swiglu", {"swiglu_epilogue": False}, "swiglu_unfused",
             "a second verified engine with the verify block's SwiGLU as a kernel of its own "
             "(swiglu_epilogue off): forced rows and verify block side by "
             "side", verify=True),
    SwitchAB("--ab-tape-apart", {"tape_epilogue": False}, "tape_apart",
             "a second verified engine whose verify blocks run the tape's kernel after the "
             "in-projection's GEMM (tape_epilogue off; on by default: the "
             "tape written in the GEMM's epilogue where its timing chooses): forced rows and "
             "verify block side by side", verify=True),
    SwitchAB("--ab-int4-unfused", {"fuse_int4": False}, "int4_unfused",
             "with --draft int4: a second verified engine whose int4 draft leaves its blocks' "
             "small kernels to inductor (fuse_int4 off; on by default: "
             "ops.int4_fused, the prologue a launch of its own, then the GEMV with its "
             "epilogue): forced rows and draft step side by side"),
    SwitchAB("--ab-decode-sdpa", {"decode_attention_tokens": 0}, "decode_sdpa",
             "hybrid shapes: a second verified engine whose one-token steps (the draft's, the "
             "exact runs') attend through SDPA over the whole KV buffer under a mask "
             "(decode_attention_tokens 0; 17 by default: ops.decode_attention reads "
             "only the stored entries): forced rows, draft step, exact step and exact run side "
             "by side (see --max-context)", exact=True),
    SwitchAB("--ab-block-rows", {"decode_attention_tokens": 1}, "block_rows",
             "hybrid shapes: a second verified engine whose verify blocks attend through "
             "rows_attention over their graph's KV window under a mask ("
             "decode_attention_tokens at 1; 17 by default: ops.decode_attention's block form reads "
             "only the stored entries): forced rows and verify block side by side",
             verify=True),
    SwitchAB("--ab-span-4", {"shortest_span_block": 4}, "span4",
             "a second verified engine with a compiled verify forward of 5 rows for blocks of "
             "up to 4 drafts as well (shortest_span_block 4; 8 by default: "
             "such blocks run the 9-row forward, padded). Under the app's policy at forced 0.95 "
             "it drafts 4-5 a block (mean k 4.49 at 4B), where a forward "
             "costs about its rows; the policy's cost model gives +1.8%% if 5 rows cost 1.15 "
             "BF16 steps against 9 rows' 1.227. Use with --adaptive-only: its policy costs "
             "(policy_costs_ms_span4) hold the 5-row block's time"),
    SwitchAB("--ab-beta", {"fold_beta": False}, "beta_unfused",
             "a second verified engine whose one-token exact steps take sigmoid(b) as a kernel "
             "of their own (fold_beta off): forced rows, exact step and exact run "
             "side by side", exact=True),
)


@torch.no_grad()
def peak_head(model, num_tokens: int = 64, factor: float = 4.0, seed: int = 1) -> list[int]:
    """Scale a few LM-head rows (tied: their embeddings too) so greedy picks among them with
    clear margins; returns their ids."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(model.config.vocab_size, generator=gen)[:num_tokens].cuda()
    model.lm_head.weight[rows] *= factor
    return rows.tolist()


# What a checked block teaches the draft-length policy (unimax.draft_length.DraftLength.observe
# writes these): ForcedDrafts takes a shielded block's lesson back by restoring them.
EVIDENCE = ("agreed", "checked", "next_probe")


def evidence(policy) -> tuple:
    return tuple(getattr(policy, name) for name in EVIDENCE)


class ForcedDrafts:
    """Drafts at a known acceptance: each block's real draft runs (same work), then its tokens
    are replaced on the device by the tokens the verifier is expected to emit, each position
    corrupted with probability 1 - rate. The expected stream is the same engine's own verified
    reply (``stream``): the verifier's rows are computed independently of how the reply was cut
    into blocks (same block length, same kernels; the rewind runs the same recurrence), so it
    emits that stream again. Where it does not (a different kernel for a short last block), the
    stream is recomputed from the reply so far by ``bf16_engine``, a BF16 engine whose step
    rounds as the verifier's view does, and that time is taken out of the measurement
    (``excluded_s``, ``resyncs``; the blocks drafted from a stale stream, ``shielded``, keep
    their time but not their say in the draft-length policy).

    The replacement is picked on the device from the draft's own position (a block's drafts are
    queued before the host has read the block before: engine.pipelined), so the stream and the
    corruption pattern live on the device too."""

    def __init__(self, engine, bf16_engine, ids, new: int, rate: float, stream: list[int],
                 seed: int = 0, draft_block: int | None = None):
        self.engine, self.bf16, self.ids, self.new = engine, bf16_engine, ids, new
        self.draft_block = draft_block
        self.vocab = engine.exact_model.config.vocab_size
        self.length = new + 64 + engine.block_size  # stream positions a draft can reach
        gen = torch.Generator().manual_seed(seed)
        self.wrong = (torch.rand(self.length, generator=gen) >= rate).to(ids.device)
        self.stream = list(stream)
        self.stream_dev = torch.zeros(self.length, dtype=torch.long, device=ids.device)
        self.reply: list[int] = []
        self.excluded_s = 0.0
        self.resyncs = self.shielded = 0
        self.before, self.shield = (0.0, 0.0, 0), False

    def _upload(self) -> None:
        tokens = self.stream[:self.length]
        self.stream_dev.zero_()
        self.stream_dev[:len(tokens)].copy_(torch.tensor(tokens, device=self.ids.device))

    def on_block(self, tokens: list[int]) -> bool:
        self.reply.extend(tokens)
        policy = self.engine.draft_length
        diverged = self.stream[:len(self.reply)] != self.reply
        if self.shield or diverged:
            # A block whose drafts came from a stream the verifier did not emit (it diverged
            # here, or, pipelined, the block was drafted before the last resync): its
            # rejection is the bench's, not the rate's. Its time counts; its evidence is taken
            # back from the draft-length policy, which would otherwise fall to k = 0 after a
            # near tie at "acceptance 1.0" (mean k 0.12 at 1.0).
            for name, value in zip(EVIDENCE, self.before, strict=True):
                setattr(policy, name, value)
            self.shielded += 1
        self.before = evidence(policy)
        self.shield = diverged and self.engine.pipelined
        if diverged:
            torch.cuda.synchronize()
            began = time.perf_counter()
            prefix = torch.tensor([self.reply], device=self.ids.device)
            # whole blocks only after the first token: each shorter last block would be a graph
            # captured (and its step run eagerly first) in the middle of the row, seconds at 4B
            # (a 4B adaptive row at 1.0 took 28 s for 5 resyncs, and
            # the next row's 16 patterns did not finish within the call)
            count = self.new + 16 - len(self.reply)
            count += -(count - 1) % self.bf16.block_size
            more = self.bf16.generate(torch.cat([self.ids, prefix], dim=1), count,
                                      mode="fast").tokens
            self.stream = self.reply + more
            self._upload()
            torch.cuda.synchronize()
            self.excluded_s += time.perf_counter() - began
            self.resyncs += 1
        return True

    def run(self) -> unimax.Generation:
        graph = self.engine.decode_graph
        real = graph.run_block
        # the reply index of a block's first draft: the decoder has fed the prompt and every
        # reply token but the last (its first token) before the block
        base = self.ids.shape[1] - 1

        def run_block(n, record=False):
            out = real(n, record=record)
            index = graph.cache.position - n - base + torch.arange(n, device=out.device)
            index = index.clamp(max=self.length - 1)
            tokens = self.stream_dev.index_select(0, index)
            wrong = self.wrong.index_select(0, index)
            out.copy_(torch.where(wrong, (tokens + 1) % self.vocab, tokens)[None])
            return out

        graph.run_block = run_block
        self.reply, self.excluded_s = [], 0.0  # (resyncs and shielded add up over runs: a
        # warm-up's resyncs leave the stream fixed for the timed runs, and the row says so)
        self.before, self.shield = evidence(self.engine.draft_length), False
        self._upload()
        try:
            result = self.engine.generate(self.ids, self.new, mode="verified",
                                          on_block=self.on_block,
                                          draft_block=self.draft_block)
        finally:
            graph.run_block = real
        result.decode_seconds -= self.excluded_s
        return result


def timed_generate(engine, ids, new, mode, **kw) -> unimax.Generation:
    engine.generate(ids, new, mode=mode, **kw)  # warm-up: graphs, compilation, autotuning
    runs = [engine.generate(ids, new, mode=mode, **kw) for _ in range(2)]
    return min(runs, key=lambda r: r.decode_seconds)


def exact_cell(row) -> str:
    """yes; tie@i (left the reference at a near tie: two correct BF16 paths can); NO@i; - for a
    sampled row (no single right answer)."""
    if row["exact"] is None:
        return "-"
    if row["exact"]:
        return "yes"
    div = row["divergence"]
    cell = f"{'tie' if is_near_tie(div) else 'NO'}@{div['index']} {div['gap_bf16_ulps']:.0f}ulp"
    if "float32_gap" in div:  # +: float32 ranks the reference's token higher, -: the row's
        cell += f" f32 {div['float32_gap']:+.3f} (ref off {div['reference_off_float32']:.3f})"
    return cell


def mean_k(result) -> float:
    v = result.verify
    return v.drafted_tokens / max(v.verifier_blocks, 1)


def row_of(name, result, weight_bytes, bandwidth, reference, model, ids) -> dict:
    steps = len(result.tokens) - 1
    per_token = result.decode_seconds / steps
    row = {"mode": name, "tok_s": 1 / per_token, "ms_per_token": per_token * 1e3,
           "of_floor": weight_bytes / bandwidth / per_token,
           "exact": None if reference is None else result.tokens == reference[:len(result.tokens)]}
    if result.verify is not None:
        v = result.verify
        row.update(acceptance=v.acceptance_rate, blocks=v.verifier_blocks,
                   rejected=v.rejected_blocks,
                   ms_per_block=result.decode_seconds / max(v.verifier_blocks, 1) * 1e3)
    if row["exact"] is False:
        row["divergence"] = judged_divergence(model, ids, result.tokens, reference)
    return row


def pooled_row(name, results, natural, weight_bytes, bandwidth, reference, model,
               ids) -> dict:
    """One row for a forced rate run over several corruption patterns (one seed each): the
    tokens and times pooled (all tokens over all the time), the blocks, drafts and
    rejections summed; exactness the first run's (each replays the natural stream:
    ``same_as_natural`` says whether all did); each seed's tok/s beside. Why: one 128-token
    pattern at 0.95 holds ~6 wrong positions give or take 2.5, and where they fall moves the
    row by ~10% (seed 0's pattern had 5 in 128 and 4 rejections, and
    its 1.25x BF16-only at k = 8 sat well above the ~1.1-1.15x that independent rejections
    at 0.95 give in bench/draft_policy.py's simulation with the same run's costs)."""
    row = row_of(name, results[0], weight_bytes, bandwidth, reference, model, ids)
    steps = sum(len(r.tokens) - 1 for r in results)
    seconds = sum(r.decode_seconds for r in results)
    drafted = sum(r.verify.drafted_tokens for r in results)
    accepted = sum(r.verify.accepted_draft_tokens for r in results)
    blocks = sum(r.verify.verifier_blocks for r in results)
    per_token = seconds / steps
    row.update(tok_s=1 / per_token, ms_per_token=per_token * 1e3,
               of_floor=weight_bytes / bandwidth / per_token,
               acceptance=accepted / drafted if drafted else 1.0, blocks=blocks,
               rejected=sum(r.verify.rejected_blocks for r in results),
               ms_per_block=seconds / max(blocks, 1) * 1e3, mean_k=drafted / max(blocks, 1),
               same_as_natural=all(r.tokens == natural.tokens for r in results),
               seeds=len(results),
               tok_s_by_seed=[(len(r.tokens) - 1) / r.decode_seconds for r in results])
    return row


def replay_ms(runner, key) -> float | None:
    graph = runner.graphs.get(key)
    return None if graph is None else median_device_seconds(graph.replay, 20, warmup=3) * 1e3


@torch.inference_mode()  # (its captures compile the verifier's steps where no row has yet)
def exact_parts(verifier, k: int, window, parts: dict, suffix: str = "") -> None:
    """What a token costs where the policy falls back to k = 0 (drafts too poor to pay), into
    ``parts`` (keys ending in ``suffix``): one exact step as a block of its own (snapshot,
    forward, resync) and, per step, an exact run of k steps in one graph, both captured here
    in the KV bucket ``window`` (the verifier's cache must hold a reply). BF16-only's step is
    the mark: at a low acceptance verified mode should cost what it does (the adaptive rows at
    the random weights' own acceptance ran at 0.94x BF16-only, the k = 0 block at 2.80 ms
    against BF16's 2.67; later an exact run 1.026 BF16 steps a token, the exact view's own
    sigmoid(b) kernel per layer the one kernel more)."""
    writes = [verifier.cache, verifier.snapshot, verifier.draft_cache]
    with verifier.cache.attending(window):
        verifier.runner.prepare(verifier.graph_key(0, 1, window, False),
                                lambda: verifier._verify(0, False, 1), writes=writes,
                                buffers=verifier._buffers())
        verifier.runner.prepare(verifier.run_key(k, window, False),
                                lambda: verifier._exact_steps(k), writes=writes,
                                buffers=verifier._buffers())
    parts["exact_step_ms" + suffix] = replay_ms(verifier.runner,
                                                verifier.graph_key(0, 1, window, False))
    run_ms = replay_ms(verifier.runner, verifier.run_key(k, window, False))
    parts[f"exact_run_{k}_per_step_ms" + suffix] = None if run_ms is None else run_ms / k


def exact_kernels(verifier, k: int, window, kernels: dict, suffix: str = "") -> None:
    """The kernels of exact_parts' graphs (captured there first), into ``kernels``."""
    kernels["exact step (a k = 0 block)" + suffix] = kernels_of(
        verifier.runner, verifier.graph_key(0, 1, window, False), 1)
    kernels[f"exact run of {k} (per step)" + suffix] = kernels_of(
        verifier.runner, verifier.run_key(k, window, sampled=False), k)


def pdl_of(owner, run: bool = False) -> dict:
    """A decoder's or verifier's PDL choice (unimax.graph.MaxTurboGraphDecoder.choose_pdl,
    unimax.verifier.Verifier.choose_pdl; ``run``: the verifier's for its exact runs): the
    setting kept and each timed setting's ms a block (none timed: PDL set, no PDL here, or an
    eager verifier), the setting named as in ``block_ms`` ("fp8@end": signalled at the end)."""
    if run:
        return {"kept": pdl_label(owner.pdl_run, owner.pdl_run_trigger),
                "block_ms": owner.pdl_run_ms}
    return {"kept": pdl_label(owner.pdl, owner.pdl_trigger), "block_ms": owner.pdl_ms}


def bench_shape(shape, args, bandwidth) -> dict:
    config = SHAPES[shape]
    if args.max_context and config.has_attention:
        config = dataclasses.replace(config, max_context=args.max_context)
    model = GDNForCausalLM.random(config, device="cuda", dtype=torch.bfloat16, seed=0)
    if args.peak:
        peak_head(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), device="cuda", generator=gen)
    start = time.perf_counter()
    reference = unimax.exact_greedy_tokens(model, ids, args.new)[0].tolist()
    print(f"[{shape}] reference in {time.perf_counter() - start:.0f} s", flush=True)
    weight_bytes = decode_weight_bytes(model)
    k = args.block
    rows, parts = [], {}

    def emit(row):
        row["at_s"] = round(time.perf_counter() - STARTED, 1)  # (a cut run: where time went)
        rows.append(row)
        print(json.dumps(row), flush=True)

    start = time.perf_counter()
    bf16 = build_engine(model, decode="bf16", block_size=k, compile_step=True)
    emit({**row_of("bf16", timed_generate(bf16, ids, args.new, "fast"), weight_bytes,
                   bandwidth, reference, model, ids),
          "warmup_s": time.perf_counter() - start})
    # The forced rows' resyncs recompute the stream the verifier would emit: a BF16 engine
    # whose step rounds as the verifier's view does (unimax.verifier.exact_view: sigmoid(b)
    # outside the recurrence's kernel), not BF16-only's, which breaks near ties its own way.
    resync = build_engine(model, decode="bf16", block_size=k, compile_step=True)
    for block in resync.decode_model.layers:  # (read when the step is first compiled)
        block.beta_in_kernel = False
    bf16_block = replay_ms(bf16.decode_graph.runner, (k, False))
    parts["bf16_step_ms"] = bf16_block / k
    parts["pdl"] = {"bf16": pdl_of(bf16.decode_graph)}
    kernels = {}
    if args.kernels:  # the profile of the graphs measured here (no second engine to build)
        kernels["bf16 step"] = kernels_of(bf16.decode_graph.runner, (k, False), k)

    def verified_engine(draft: str = args.draft, config=None):
        """A verified engine as this run's (the A/Bs' second engines too: each differs from
        the first in its kernel configuration or its --draft)."""
        return build_engine(model, decode="fp8", draft=draft, block_size=k,
                            compile_step=True, kernels=config)

    start = time.perf_counter()
    engine = verified_engine()
    natural = timed_generate(engine, ids, args.new, "verified", draft_block=k)
    emit({**row_of(f"verified-{args.draft}", natural, weight_bytes, bandwidth, reference, model,
                   ids), "warmup_s": time.perf_counter() - start})

    streams = {}  # the latest forced stream per engine (by id: one reused by a later engine
    # only gives that one a start its resyncs correct) and draft_block (k, or None: adaptive)

    def forced_row(engine, rate: float, label: str, draft_block: int | None = k,
                   draft: str = args.draft) -> None:
        """A row at a forced acceptance ``rate``: per corruption pattern (``--seeds``; one
        at 1.0, where none corrupts) the best of two runs, after a warm-up; pooled_row.
        ``draft`` names the engine's draft format in the label."""
        results, resyncs, shielded = [], [], []  # per pattern: a row's near-tie resyncs
        # may fall in one pattern (4B at 0.8, 51 over 4 patterns, one at
        # 0.85x beside 0.96-0.98x, and no way to tell where they fell)
        for seed in range(1 if rate >= 1.0 else args.seeds):
            # each pattern starts from the stream the last one left (its resyncs' corrections
            # are the verifier's own tokens too), not from the natural reply again
            key = (id(engine), draft_block)
            forced = ForcedDrafts(engine, resync, ids, args.new, rate,
                                  streams.get(key, natural.tokens), seed=seed,
                                  draft_block=draft_block)
            if not seed:
                forced.run()  # warm-up
            results.append(min((forced.run() for _ in range(2)),
                               key=lambda r: r.decode_seconds))
            resyncs.append(forced.resyncs)
            shielded.append(forced.shielded)
            streams[key] = forced.stream
        emit({**pooled_row(f"verified-{draft} @{rate}{label}", results, natural,
                           weight_bytes, bandwidth, reference, model, ids),
              "resyncs_by_seed": resyncs, "shielded_by_seed": shielded})

    # Fixed k first; then every graph captured and timed, which calibrates the draft-length
    # policy, and the same rows with k chosen per block ("adaptive", the app's default).
    for draft_block in (k,) if args.fixed_only else (None,) if args.adaptive_only else (k, None):
        if draft_block is None:
            start = time.perf_counter()
            engine.capture_graphs(verified=True)  # (the app's warm-up)
            parts["capture_graphs_s"] = time.perf_counter() - start
            parts["policy_costs_ms"] = policy_costs(engine)
            print(json.dumps({"policy_costs_ms": parts["policy_costs_ms"],
                              "capture_graphs_s": parts["capture_graphs_s"]}), flush=True)  # (a
            # cut run keeps them: the draft-length simulation, bench/draft_policy.py, reads them)
            engine.draft_length.forget()
            result = timed_generate(engine, ids, args.new, "verified")
            emit({**row_of(f"verified-{args.draft} adaptive", result, weight_bytes, bandwidth,
                           reference, model, ids), "mean_k": mean_k(result)})
        label = "" if draft_block else " adaptive"
        for rate in args.acceptance:
            engine.draft_length.forget()
            forced_row(engine, rate, label, draft_block)
        if draft_block is None and args.probe_every:  # the same rows at other probe intervals
            default = engine.draft_length.probe_every
            for every in args.probe_every:
                engine.draft_length.probe_every = every
                for rate in args.acceptance:
                    engine.draft_length.forget()
                    forced_row(engine, rate, f" adaptive probe {every}", None)
            engine.draft_length.probe_every = default
        if draft_block and args.acceptance and not args.fixed_only:  # the first rate again,
            # with the plain loop
            engine.pipelined = False
            forced_row(engine, args.acceptance[0], " plain loop")
            engine.pipelined = True
    for temperature in args.temperature:  # sampled: BF16-only against verified sampling
        params = unimax.SamplingParams(temperature=temperature, seed=0)
        for name, eng, mode in (("bf16", bf16, "fast"),
                                (f"verified-{args.draft} adaptive", engine, "verified")):
            result = timed_generate(eng, ids, args.new, mode, sampling=params)
            row = row_of(f"{name} @T{temperature:g}", result, weight_bytes, bandwidth, None,
                         model, ids)
            emit({**row, "mean_k": mean_k(result)} if result.verify else row)
    del bf16

    verifier = engine.verifier
    window = engine.verifier.window_for(PROMPT + args.new)
    parts["draft_step_ms"] = replay_ms(engine.decode_graph.runner, (k, False)) / k
    parts["pdl"]["draft"] = pdl_of(engine.decode_graph)
    parts["pdl"]["verifier"] = pdl_of(engine.verifier)
    parts["pdl"]["verifier_run"] = pdl_of(engine.verifier, run=True)
    parts[f"verify_{k}_ms"] = replay_ms(verifier.runner,
                                        verifier.graph_key(k, k + 1, window, sampled=False))
    for b in verifier.span_blocks[:-1]:  # the shorter compiled forwards (block > 8), where
        # the adaptive rows captured them: a block of b drafts, as the policy prices it
        ms = replay_ms(verifier.runner, verifier.graph_key(b, b + 1, window, sampled=False))
        if ms is not None:
            parts[f"verify_{b}_ms"], parts[f"verify_{b}_over_bf16"] = ms, ms / parts[
                "bf16_step_ms"]
    length = k // 2
    # (the rollback runs inside each verify graph; timed alone here, as its own graph, in the
    # form the verify block runs: one pass writing the draft's cache too, or the plain form)
    copy_to = verifier.draft_cache if verifier.one_pass else None
    with torch.inference_mode():
        verifier.runner.prepare(("rewind", length), lambda: model.rewind_unchecked(
            verifier.cache, verifier.snapshot, verifier.tape, length, copy_to=copy_to),
                                writes=[verifier.cache, verifier.snapshot, verifier.draft_cache])
    parts["rewind_ms"] = replay_ms(verifier.runner, ("rewind", length))
    exact_parts(verifier, k, window, parts)
    if args.kernels:
        kernels["draft step"] = kernels_of(engine.decode_graph.runner, (k, False), k)
        kernels[f"verify {k} (per block)"] = kernels_of(
            verifier.runner, verifier.graph_key(k, k + 1, window, sampled=False), 1)
        exact_kernels(verifier, k, window, kernels)
    if args.ab_block_op:  # the same verify block with the tape written by the torch forms
        verify_without_block_op(verified_engine, ids, args, k, window, parts, kernels)
    for ab in SWITCH_ABS:  # second engines with one module flag flipped
        if getattr(args, ab.flag.removeprefix("--").replace("-", "_")):
            with_switch(ab.changes, ab.label, verified_engine, args, k, parts, forced_row,
                        verify=ab.verify, exact=ab.exact)
    if args.ab_short_tile:  # the few-token recurrence at another launch setting
        with_short_tile(model, verified_engine, args, k, parts, forced_row)
    if args.ab_draft:  # another draft format (int4: unimax.int4), its own acceptance too
        other = verified_engine(draft=args.ab_draft)
        result = timed_generate(other, ids, args.new, "verified", draft_block=k)
        emit(row_of(f"verified-{args.ab_draft}", result, weight_bytes, bandwidth, reference,
                    model, ids))
        second_engine_rows(other, args.ab_draft, args, k, parts, forced_row,
                           draft=args.ab_draft)
    base = parts["bf16_step_ms"]
    # A full block's replays against the block's measured time (forced 1.0, fixed k, the plain
    # loop: every block drafts k after the host read the block before): the rest is the host's
    # share (its sync, Python, graph launches) and idle GPU between blocks, which the pipelined
    # loop (the default, the row without "plain loop") hides behind the drafts.
    full = next((r for r in rows if r["mode"].endswith("@1.0 plain loop")), None)
    if full is not None and parts[f"verify_{k}_ms"]:
        parts["replays_per_block_ms"] = k * parts["draft_step_ms"] + parts[f"verify_{k}_ms"]
        parts["host_and_gaps_per_block_ms"] = full["ms_per_block"] - parts["replays_per_block_ms"]
    parts.update({"draft_over_bf16": parts["draft_step_ms"] / base,
                  f"verify_{k}_over_bf16": (parts[f"verify_{k}_ms"] or 0) / base,
                  "rewind_over_bf16": (parts["rewind_ms"] or 0) / base,
                  "exact_step_over_bf16": (parts["exact_step_ms"] or 0) / base,
                  f"exact_run_{k}_per_step_over_bf16":
                      (parts[f"exact_run_{k}_per_step_ms"] or 0) / base,
                  "floor_ms": weight_bytes / bandwidth * 1e3})
    print(json.dumps(parts), flush=True)
    return {"rows": rows, "parts": parts, "weight_bytes": weight_bytes,
            "peaked_head": args.peak, "kernels": kernels, "choices": kernel_choices(),
            "margins_us": choice_margins()}



def verify_without_block_op(verified_engine, ids, args, k: int, window, parts: dict,
                            kernels: dict) -> None:
    """A second verified engine with the kernel configuration's block_op off (the recording
    forward's conv, gates and tape copies as the torch forms, not ops.block_mixer's one
    kernel; the recurrence is the few-token op either way): its verify block of k drafts timed
    (and profiled) beside the first engine's, in the same process, on the same model."""
    other = verified_engine(config=unimax.kernels.active().but(block_op=False))
    other.generate(ids, 4 * (k + 1), mode="verified", draft_block=k)  # captures the block
    verifier = other.verifier
    key = verifier.graph_key(k, k + 1, window, sampled=False)
    parts[f"verify_{k}_ms_without_block_op"] = replay_ms(verifier.runner, key)
    if args.kernels:
        kernels[f"verify {k} without the block op (per block)"] = kernels_of(
            verifier.runner, key, 1)


def with_switch(changes: dict, label: str, verified_engine, args, k: int, parts: dict,
                forced_row, verify: bool = False, exact: bool = False) -> None:
    """A second verified engine built with the run's kernel configuration but ``changes``
    (unimax.kernels; the engine keeps it for its calls): its forced rows and draft step
    (``verify``: its verify block too) beside the first engine's, in the same process, under
    ``label`` (second_engine_rows). ``exact``: its exact step and exact run too
    (exact_parts)."""
    other = verified_engine(config=unimax.kernels.active().but(**changes))
    second_engine_rows(other, label, args, k, parts, forced_row, verify=verify, exact=exact)


def with_short_tile(model, verified_engine, args, k: int, parts: dict, forced_row) -> None:
    """A second verified engine whose few-token recurrence (blocks and rewinds) runs at the
    launch setting ``args.ab_short_tile`` (e.g. short@4x1x8, the choice timed per call at the
    block alone) where the first runs the verifier's choice (ops.short_recurrence.
    choose_for_blocks): forced rows and verify block side by side. The choice is per process
    and read as graphs are captured: the first engine's graphs keep theirs."""
    from unimax.ops import short_recurrence as short

    cfg = model.config
    key = (cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads, cfg.head_v_dim, model.dtype, False)
    was = short.CHOICES.get(key)
    parts["short_tile"] = was
    short.parse(args.ab_short_tile)  # (names a bad setting before the engine is built)
    short.CHOICES[key] = args.ab_short_tile
    try:
        other = verified_engine()
        second_engine_rows(other, args.ab_short_tile.replace("@", "_"), args, k, parts,
                           forced_row, verify=True)
    finally:
        if was is None:
            short.CHOICES.pop(key, None)
        else:
            short.CHOICES[key] = was


def policy_costs(engine) -> dict:
    """The draft-length policy's calibrated costs (ms), as bench/draft_policy.py reads them."""
    policy = engine.draft_length
    return {"draft": policy.draft_ms, "verify": policy.verify_ms, "rewind": policy.rewind_ms}


def second_engine_rows(other, name: str, args, k: int, parts: dict, forced_row,
                       verify: bool = False, exact: bool = False,
                       draft: str | None = None) -> None:
    """A second verified engine's forced rows (labelled ``name``) and its draft step, beside
    the first engine's in the same process (the A/B options); ``verify``: its verify block of
    k drafts too, in its own KV window for the rows' length (a switch may give it buckets
    where the first engine has one window, verifier.one_window, or the other way round; None
    on pure GDN models); ``exact``: its exact step and exact run (exact_parts), in that window;
    ``draft``: the second engine has another draft format (--ab-draft), which its rows are
    labelled with instead. Under --adaptive-only its rows are adaptive too, its policy
    calibrated from its own graphs, as the first engine's."""
    draft_block = None if args.adaptive_only else k
    window = other.verifier.window_for(PROMPT + args.new)
    if draft_block is None:
        start = time.perf_counter()
        other.capture_graphs(verified=True)  # (after the first engine's: the compiles they
        # share are warm)
        parts[f"capture_graphs_s_{name}"] = time.perf_counter() - start
        parts[f"policy_costs_ms_{name}"] = policy_costs(other)
    label = " adaptive" if draft_block is None else ""
    if draft is None:
        label += f" {name.replace('_', '-')}"
    for rate in args.acceptance:
        other.draft_length.forget()
        forced_row(other, rate, label, draft_block, draft=draft or args.draft)
    base = parts["bf16_step_ms"]
    parts[f"draft_step_ms_{name}"] = replay_ms(other.decode_graph.runner, (k, False)) / k
    parts["pdl"][f"draft_{name}"] = pdl_of(other.decode_graph)
    parts[f"draft_over_bf16_{name}"] = parts[f"draft_step_ms_{name}"] / base
    if verify:
        ms = replay_ms(other.verifier.runner,
                       other.verifier.graph_key(k, k + 1, window, sampled=False))
        parts[f"verify_{k}_ms_{name}"] = ms
        parts[f"verify_{k}_over_bf16_{name}"] = (ms or 0) / base
    if exact:
        exact_parts(other.verifier, k, window, parts, f"_{name}")
        for key in ("exact_step", f"exact_run_{k}_per_step"):
            parts[f"{key}_over_bf16_{name}"] = (parts[f"{key}_ms_{name}"] or 0) / base


def kernels_of(runner, key, per: int) -> dict | None:
    """One replay's kernels grouped by name (bench/profile_step.py), per step of ``per``; None
    where the runner has no such graph."""
    graph = runner.graphs.get(key)
    if graph is None:
        return None
    rows, busy, count = kernel_table(graph.replay, per)
    # every kernel in the JSON (the verify block's ~24 per layer are the next lever: which
    # ones, by name and count); the table prints the first 14
    return {"busy_us": busy, "kernels": count, "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["gdn-4b", "qwen3.5-4b", "gdn24-0.8b"],
                        choices=list(SHAPES))
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--draft", default="full", choices=DRAFTS)
    parser.add_argument("--ab-draft", default=None, choices=DRAFTS,
                        help="also a second verified engine with this draft (int4: the body in "
                             "4 bits, unimax.int4), its natural and forced rows and its draft "
                             "step beside the first's; adaptive rows under --adaptive-only")
    parser.add_argument("--acceptance", type=float, nargs="*", default=[1.0, 0.95, 0.9, 0.8])
    parser.add_argument("--no-peak", dest="peak", action="store_false",
                        help="keep the random LM head as it is (flat logits)")
    parser.add_argument("--temperature", type=float, nargs="*", default=[],
                        help="also sampled rows (seed 0) at each temperature: BF16-only and "
                             "verified, adaptive k")
    parser.add_argument("--kernels", action="store_true",
                        help="also the kernels of the BF16 step, the draft step, the verify "
                             "block and an exact run (the captured graphs measured here)")
    parser.add_argument("--no-fuse-bf16", action="store_true",
                        help="BF16-only's fast step and the verifier's view without the "
                             "folded GEMVs (the kernel configuration's fuse_bf16 off; on by "
                             "default)")
    parser.add_argument("--no-block-op", action="store_true",
                        help="the verifier's recording forwards write the tape through the "
                             "torch forms, not one op per GDN layer "
                             "(the kernel configuration's block_op; on by default)")
    parser.add_argument("--ab-block-op", action="store_true",
                        help="also a second verified engine without the block op, its verify "
                             "block timed beside the first's (parts: verify_K_ms_without_"
                             "block_op)")
    parser.add_argument("--pdl", nargs="?", const="all", default="auto",
                        choices=["auto", "off", "all", "fp8"],
                        help="programmatic dependent launch of the fused GEMVs and the "
                             "verifier's tensor-core GEMMs (the kernel configuration's pdl): auto "
                             "(the default, as the app): each decoder, and the compiled "
                             "verifier for its blocks and its exact runs apart, times a block "
                             "with and without and keeps the faster (the choices print as "
                             "'pdl'); off; all: every one of those kernels; fp8: the GEMVs "
                             "over FP8 weights only (the draft's)")
    parser.add_argument("--pdl-trigger", choices=["auto", "start", "end"], default="auto",
                        help="with --pdl: where each program lets the next kernel launch "
                             "(its pdl_trigger): auto (the default, as the "
                             "app): --pdl auto times both, 'all' and 'fp8' signal at the start; "
                             "start or end: there only")
    parser.add_argument("--seeds", type=int, default=16,
                        help="corruption patterns per forced rate below 1.0, pooled into its "
                             "row (one pattern alone misleads: four at k = 8 had 17 rejections "
                             "where 22.9 are expected; a 4B forced run takes ~0.3 s)")
    parser.add_argument("--adaptive-only", action="store_true",
                        help="only the adaptive rows (the fixed-k rows' forced runs skipped)")
    parser.add_argument("--probe-every", type=int, nargs="*", default=[], metavar="N",
                        help="also the adaptive forced rows with the policy probing after N "
                             "exact steps (DraftLength.probe_every; the app's is 32): "
                             "bench/draft_policy.py's simulated trade, on the engine")
    parser.add_argument("--fixed-only", action="store_true",
                        help="only the fixed-k rows (no plain-loop or adaptive rows: their "
                             "graph captures take minutes; one device call then holds the run)")
    parser.add_argument("--ab-short-tile", default=None, metavar="NAME",
                        help="also a verified engine whose few-token recurrence runs at this "
                             "launch setting (e.g. short@4x1x8): forced rows and verify block "
                             "beside the verifier's own choice's")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the hybrid shapes' KV buffers (tokens; default the shape's: "
                             "2048 at qwen3.5-4b, 4096 at qwen3.5-0.8b; the L4 presets' are "
                             "8192)")
    for ab in SWITCH_ABS:
        parser.add_argument(ab.flag, action="store_true", help=ab.help)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if any(every < 1 for every in args.probe_every):
        parser.error(f"--probe-every takes intervals of at least 1 step, got {args.probe_every}")
    if args.probe_every and args.fixed_only:
        parser.error("--probe-every sets the adaptive policy's interval: drop --fixed-only")
    # the run's kernel configuration, in force for every engine it builds (unimax.kernels)
    run_config = unimax.kernels.DEFAULT.but(
        fuse_bf16=not args.no_fuse_bf16, block_op=not args.no_block_op,
        pdl={"auto": "auto", "off": False, "all": True, "fp8": "fp8"}[args.pdl],
        pdl_trigger=args.pdl_trigger)
    with unimax.kernels.using(run_config):
        bandwidth = copy_bandwidth()
        report = {"device": torch.cuda.get_device_name(), "copy_GBps": bandwidth / 1e9,
                  "shapes": {}}
        for shape in args.shapes:
            try:
                report["shapes"][shape] = bench_shape(shape, args, bandwidth)
            except Exception as err:  # record, go on with the next shape
                report["shapes"][shape] = {"error": repr(err)[:500]}
                print(json.dumps({"shape": shape, "error": repr(err)[:500]}), flush=True)
            torch.cuda.empty_cache()
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s, block {args.block}")
    for shape, data in report["shapes"].items():
        if "error" in data:
            print(f"{shape}: error {data['error'][:200]}")
            continue
        bf16 = data["rows"][0]["tok_s"]
        print(f"\n{shape} ({data['weight_bytes'] / 1e9:.2f} GB/token)")
        print(f"{'mode':<30}{'tok/s':>7}{'x bf16':>7}{'floor%':>7}{'accept':>7}{'mean k':>7}"
              f"{'ms/blk':>7}  exact")
        for r in data["rows"]:
            print(f"{r['mode']:<30}{r['tok_s']:>7.0f}{r['tok_s'] / bf16:>7.2f}"
                  f"{100 * r['of_floor']:>7.1f}{r.get('acceptance', float('nan')):>7.2f}"
                  f"{r.get('mean_k', float('nan')):>7.2f}"
                  f"{r.get('ms_per_block', float('nan')):>7.2f}  {exact_cell(r)}"
                  + (f"  resyncs {'/'.join(map(str, r['resyncs_by_seed']))}"
                     if any(r.get("resyncs_by_seed", ())) else "")
                  + (f" shielded {'/'.join(map(str, r['shielded_by_seed']))}"
                     if any(r.get("shielded_by_seed", ())) else "")
                  + (f"  seeds {'/'.join(f'{t / bf16:.2f}' for t in r['tok_s_by_seed'])}"
                     if r.get("seeds", 1) > 1 else ""))
        p = data["parts"]
        print("parts (ms): " + ", ".join(f"{key} {value:.3f}" for key, value in p.items()
                                         if isinstance(value, float)))
        print(f"pdl: {json.dumps(p.get('pdl'))}")
        print("kernel choices: " + "; ".join(f"{key}: {name}" for key, name in sorted(
            data.get("choices", {}).items())))
        print("timed choices, fastest two (us): " + "; ".join(
            f"{key}: " + ", ".join(f"{name} {us:.1f}" for name, us in best)
            for key, best in data.get("margins_us", {}).items()))
        for name, table in data.get("kernels", {}).items():
            if table is None:
                continue
            print(f"\n{name}: busy {table['busy_us']:.0f} us, {table['kernels']:.0f} kernels")
            for row in table["top"][:14]:
                print(f"  {row['us']:8.1f} us {row['calls']:5.1f}x  {row['name'][:90]}")


if __name__ == "__main__":
    main()
