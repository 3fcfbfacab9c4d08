"""The verifier: checks the draft's blocks with the exact model, so verified decoding emits
exactly the exact model's greedy tokens.

Per block of k drafts: snapshot the exact state (a preallocated cache), run the exact model once
over [current, draft] (k + 1 tokens, every position's prediction from one read of the weights),
and count the agreeing prefix m on the device. The block emits draft[:m] and the exact
prediction at m: k + 1 tokens when every draft is accepted (the last one a bonus the exact model
computed anyway), and always at least one exact token, so a block of k = 0 is an exact step.

The exact cache went k + 1 tokens ahead, but only m + 1 are kept: in the same graph, with m on the
device (no host round trip between the check and the rollback), it is rewound from the tape its
forward recorded (unimax.tape: the convolution window and the recurrence over the first m + 1
recorded steps, later ones masked out; no weight read; a full block rewinds to where it is), the
draft's cache is resynced from it (the draft never fed its last token, and a full-FP8 draft's states
drift) and the next block's first token is set. The rewind moves the recurrent states in one pass
(the kernel configuration's ``one_pass_rewind``): it keeps the state before the block in the
snapshot and writes the state after it to both caches. One CUDA graph per k (and per KV bucket on
hybrid models); with ``compile=True`` the forwards of the span blocks (the full block, and up to 8
drafts where block_size > 8: ``span_blocks``) and of k = 0 run the small-M linears and are compiled
by inductor first, like the decode step. A block of k drafts runs the forward of the smallest span
block that holds it, padded (``span``): its rows past k + 1 are computed and ignored, and the rewind
masks their steps out as it does a rejection's. (An eager forward of k + 1 rows cost more than the
compiled full block on the H200: 7.0-7.5 against 4.45 ms at 4B, which left the draft-length policy
only k = 0 or the full block.) Which k a block drafts is the engine's choice (unimax.draft_length).
With sampling on, the block keeps drafts by the speculative rule instead of by agreement
(unimax.speculative): same forward, same rewind. Where the policy falls back to k = 0, several exact
steps run as one block ("exact run", ``_exact_steps``): one graph and one host sync for up to
block_size tokens.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from . import kernels
from .attention import kernel_attends
from .cache import CacheCopier, RecurrentCache
from .graph import (
    GraphRunner,
    MaxTurboGraphDecoder,
    pdl_signature,
    pdl_timable,
    timed_pdl_choice,
)
from .held import TokenToHost, choose, logits_buffer
from .ops import pdl
from .ops.gated_delta import fla_ops
from .ops.short_recurrence import choose_for_blocks
from .sampling import sample_from_logits, warped_probs
from .speculative import speculative_step


def span_blocks(block_size: int, shortest: int = 8) -> tuple[int, ...]:
    """The draft counts whose blocks get a compiled forward of their own (count + 1 rows),
    ascending: the powers of two from ``shortest`` (the kernel configuration's
    ``shortest_span_block``) below block_size, and block_size.

    Why: a forward costs about its rows' count whatever k it checks (4B on the H200: every
    block of 1..16 drafts padded to 17 rows cost 4.16-4.24 ms, of 1..8 padded to 9 rows
    3.51-3.61), so with one padded forward a longer block_size taxes every short block; each
    span block is one more whole-model compilation at warm-up (tens of seconds at 4B), hence
    none below 8, where the draft-length policy's simulation gained nothing. At 4 (Qwen3.5-4B
    shape, H100, forced 0.95): 0.96x BF16-only against 1.23x at 8, its 5-row forward rounding
    apart from the 9-row one."""
    blocks, b = [block_size], shortest
    while b < block_size:
        blocks.insert(-1, b)
        b *= 2
    return tuple(blocks)


@dataclass
class VerifyCounts:
    drafted: int = 0
    accepted: int = 0
    rejected_blocks: int = 0
    verifier_blocks: int = 0


def allow_recompiles(limit: int = 512) -> None:
    """One compiled forward per block length (and KV bucket) is many more variants than
    dynamo's default limit of 8, past which it silently runs the rest eagerly."""
    import torch._dynamo.config as config

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


def exact_view(exact_model):
    """The view the verifier compiles: the exact model's linears through the small-M GEMVs,
    its one-token forwards (k = 0, exact runs) folded as BF16-only's step is (the kernel
    configuration's ``fuse_bf16``), its blocks of k + 1 rows in the plain forms but for the MLPs'
    gate-up GEMM, which takes SwiGLU into its epilogue (ops.gemv_swiglu). sigmoid(b) is rounded as
    the block's torch forms round it, not inside the one-token recurrence
    kernel, so that the exact runs and the blocks round the gates alike."""
    from . import fused_draft
    from .fast_step import gemv_view

    view = gemv_view(exact_model, fuse=False)
    config = kernels.active()
    if config.fuse_fp8 and config.fuse_bf16:
        fused_draft.fuse_blocks(view, bf16=True, beta_in_kernel=False)
    return view


class Verifier:
    def __init__(self, exact_model, exact_cache: RecurrentCache,
                 decoder: MaxTurboGraphDecoder, resync_draft: CacheCopier,
                 compile: bool = False, drafter=None):
        """``drafter``: the MTP drafter (unimax.mtp_draft) where the model's MTP module drafts:
        the drafts come from it, each block leaves it the forward's hidden states (its
        ``catch_up``, inside the block's graph), and there is no draft cache to resync."""
        self.model = exact_model
        self.cache = exact_cache
        self.decoder = decoder
        self.drafter = drafter
        # where the drafts are read: the draft decoder's output, or the MTP drafter's
        self.draft_tokens = decoder.out_tokens if drafter is None else drafter.out_tokens
        # exact cache -> the draft's cache, after every block: the exact cache has fed the
        # draft's last token, which the draft has not (and a full-FP8 draft's states drift)
        self.resync_draft = resync_draft
        self.block_size = decoder.block_size
        config = kernels.active()
        # (the compiled forwards' lengths - 1)
        self.span_blocks = span_blocks(self.block_size, config.shortest_span_block)
        # Hybrid models on CUDA: where every attention call of the verifier's forwards (its
        # blocks, the one-token exact runs) goes through ops.decode_attention, which reads only
        # the entries stored, the KV window changes nothing a graph computes: one window (the
        # whole buffer) and one set of graphs, not a set per power-of-two bucket (at an 8k
        # buffer six sets, at 32k eight, each compiled and captured at start-up).
        self.one_window = exact_cache.has_attention and kernel_attends(
            exact_cache, self.span_blocks[-1] + 1, exact_model.config.attn_head_dim,
            exact_model.dtype)
        self.snapshot = exact_cache.empty_like(share_kv=True)  # preallocated, reused
        self.take_snapshot = CacheCopier(self.snapshot, exact_cache)
        # A block of k > 0 drafts: the rewind moves the exact model's GDN states in one pass:
        # it reads them from the exact cache (the recording forward left them as they were)
        # and writes the snapshot, the cache and the draft's cache (rewind_unchecked's
        # ``copy_to``), so the snapshot and resync copy only the conv states and the position.
        # Off: the full snapshot, the rewind into a new tensor, its copy and the full resync
        # (4B: 67 MB read and written four times instead of once and three).
        # (the one-pass form writes the draft's cache too: an MTP drafter has none)
        self.one_pass = config.one_pass_rewind and drafter is None
        self.draft_cache = resync_draft.dst
        self.take_snapshot_conv = CacheCopier(self.snapshot, exact_cache, recurrent=False)
        self.resync_draft_conv = CacheCopier(self.draft_cache, exact_cache, recurrent=False)
        self.restore_snapshot = CacheCopier(exact_cache, self.snapshot)
        self.tape = exact_model.make_tape(self.block_size + 1)
        if self.tape.conv_input.shape[0]:  # the few-token kernel's launch setting, timed for
            cfg = exact_model.config       # the blocks and their rewinds (on CUDA only)
            choose_for_blocks(cfg.num_k_heads, cfg.head_k_dim, cfg.num_v_heads, cfg.head_v_dim,
                              exact_model.dtype, self.tape.conv_input.shape[0],
                              self.block_size + 1, exact_cache.device)
        long = dict(dtype=torch.long, device=exact_cache.device)
        self.current = torch.zeros(1, 1, **long)  # the last emitted token, not yet fed
        self.inputs = torch.zeros(1, self.block_size + 1, **long)
        self.predictions = torch.zeros(1, self.block_size + 1, **long)
        self.num_accepted = torch.zeros((), **long)
        # verified sampling (unimax.speculative): its uniforms, drawn per block on the host
        self.u_accept = torch.zeros(self.block_size, device=exact_cache.device)
        self.u_final = torch.zeros(1, device=exact_cache.device)
        self.u_run = torch.zeros(self.block_size, device=exact_cache.device)  # an exact run's
        # A block's result (accepted count, drafts, exact predictions), copied out right after
        # its graph: the next block's drafts may already be queued behind it (engine.py), and
        # they overwrite the decoder's out_tokens. On CUDA the host copy is pinned and its
        # arrival an event, so the host waits for this block only, not for the drafts after it.
        size = 2 * self.block_size + 2
        self.result = torch.zeros(size, **long)
        cuda = exact_cache.device.type == "cuda"
        self.result_host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self.result_ready = torch.cuda.Event() if cuda else None
        # A reply held to a grammar (unimax.held): the held forward's logits (allocated at its
        # first run) and the chosen token's way out
        self.held_logits: torch.Tensor | None = None
        self.held_token = TokenToHost(exact_cache.device)
        self.runner = GraphRunner(exact_cache.device, decoder.use_graphs, timed=True)
        # Programmatic dependent launch of the compiled forwards' Triton GEMMs and GEMVs
        # (the kernel configuration's pdl "auto"), chosen by timing as each decoder chooses its own
        # (``choose_pdl``): None until then, the setting kept for blocks with drafts (``pdl``)
        # and for one-token forwards (``pdl_run``: exact runs, k = 0 blocks), each setting's
        # ms a block
        self.pdl: bool | None = None
        self.pdl_run: bool | None = None
        self.pdl_trigger = self.pdl_run_trigger = "start"  # (each kind's signal: its choice's)
        self.pdl_ms: dict[str, float] = {}
        self.pdl_run_ms: dict[str, float] = {}
        # the exact forward: its logits, and (an MTP drafter) its hidden states for the drafter
        self.forward = (exact_model.forward_unchecked if drafter is None
                        else exact_model.forward_with_hidden_unchecked)
        self.compiled = None
        if compile:
            # The exact model through the small-M linears (ops/gemv.py: Triton or cuBLAS per
            # shape, W read once for the block), compiled by inductor. A few lengths are
            # compiled, each a compilation of the whole model (tens of seconds at 4B): one per
            # span block (the full block, and 9 rows for up to 8 drafts where block_size > 8),
            # and k = 0 (one exact step: the block the draft-length policy falls back to when
            # drafts are poor, which must then cost what a BF16 step does). Other blocks run
            # their span block's forward, padded (``span``); only where a hybrid's KV buffers
            # leave no room for the padding does a block run the plain forward.
            allow_recompiles()
            if cuda:
                fla_ops()  # (looked up before tracing, so that the compiled forward never imports)
            view = exact_view(exact_model)
            self.compiled = torch.compile(view.forward_unchecked if drafter is None
                                          else view.forward_with_hidden_unchecked,
                                          dynamic=False)

    def window_for(self, total: int) -> int | None:
        """The KV window a forward ending with ``total`` stored tokens reads (its graphs are
        keyed by it): the cache's bucket, or the whole buffer under ``one_window``."""
        return self.cache.max_kv_length if self.one_window else self.cache.window_for(total)

    def windows(self) -> list[int | None]:
        """Every window window_for can return."""
        return [self.cache.max_kv_length] if self.one_window else self.cache.windows()

    # --- graph bodies --------------------------------------------------------------------

    def span(self, k: int, seen: int) -> int:
        """How many inputs a block of k drafts feeds the exact forward, with ``seen`` tokens
        stored: b + 1 for the smallest of ``span_blocks`` b >= k (padded: one compiled forward
        per span block, not per k; the padding's KV lands past the position, where nothing reads
        it), except where the KV buffers have no room for it (a hybrid's last tokens): k + 1.
        k = 0 (one exact step): 1."""
        if k == 0:
            return 1
        b = next(b for b in self.span_blocks if b >= k)
        room = not self.cache.has_attention or seen + b + 1 <= self.cache.max_kv_length
        return b + 1 if room else k + 1

    def _verify(self, k: int, sampled: bool = False, span: int | None = None,
                masked: bool = False) -> None:
        """A block of k drafts (``_check``), its launches in the PDL setting chosen (k = 0,
        one exact step: the one-token forwards' setting)."""
        setting, trigger = (self.pdl_run, self.pdl_run_trigger) if k == 0 else (
            self.pdl, self.pdl_trigger)
        with pdl.auto_pdl(setting or False, trigger):
            self._check(k, sampled, span, masked)

    def _exact_steps(self, n: int, sampled: bool = False) -> None:
        """An exact run of n steps (``_exact_run``), its launches in the PDL setting chosen
        for one-token forwards."""
        with pdl.auto_pdl(self.pdl_run or False, self.pdl_run_trigger):
            self._exact_run(n, sampled)

    def _check(self, k: int, sampled: bool, span: int | None, masked: bool = False) -> None:
        """Snapshot, score [current, draft] exactly (recording the tape), then greedy: count
        the agreeing prefix; sampled: the speculative rule, its token in every prediction
        slot. Reads the draft (and its distributions) from the decoder's static buffers.
        ``span``: the forward's inputs (k + 1, or padded: see ``span``); inputs past k + 1
        are whatever the buffers hold (earlier tokens: valid ids). ``masked``: each
        position's prediction keeps to its row of the decoder's ``token_mask`` table (a
        grammar's mask after that many drafts), so the block emits the exact model's greedy
        tokens under the grammar (sampled: the speculative rule on each row's masked
        distribution, the draft's recorded under the same masks, so each token is distributed
        as the exact model's under the grammar)."""
        span = k + 1 if span is None else span
        one_pass = self.one_pass and k > 0
        (self.take_snapshot_conv if one_pass else self.take_snapshot)()
        draft = self.draft_tokens[:, :k]
        self.inputs[:, :1].copy_(self.current)
        self.inputs[:, 1:k + 1].copy_(draft)
        compiled = self.compiled and (span == 1 or span - 1 in self.span_blocks)
        forward = self.compiled if compiled else self.forward
        # k = 0 keeps its one input: no tape, no rewind, the forward writes the state itself
        with self.cache.recording(self.tape) if k else contextlib.nullcontext():
            logits = self._hidden_kept(forward(self.inputs[:, :span], self.cache,
                                               logits_to_keep=span), 0, k + 1)
        logits = logits[:, :k + 1]  # (a padded forward's later rows are not this block's)
        if masked:
            logits = self.decoder.token_mask.apply_rows(logits[0])[None]
        if sampled:
            d = self.decoder
            p = warped_probs(logits[0], d.temperature, d.top_k, d.top_p, d.min_p)
            m, token = speculative_step(p, d.draft_probs[:k], draft[0], self.u_accept[:k],
                                        self.u_final)
            self.num_accepted.copy_(m)
            self.predictions[0, :k + 1].copy_(token.expand(k + 1))
        else:
            self.predictions[:, :k + 1].copy_(logits.argmax(dim=-1))
            agree = self.predictions[0, :k].eq(draft[0]).long()
            self.num_accepted.copy_(agree.cumprod(dim=0).sum())
        if k:  # the state after the accepted prefix, from the tape (the forward left it);
            # at most k + 1 steps count, however many the (padded) forward recorded
            self.model.rewind_unchecked(self.cache, self.snapshot, self.tape,
                                        self.num_accepted + 1, k + 1,
                                        copy_to=self.draft_cache if one_pass else None)
        if self.drafter is None:
            (self.resync_draft_conv if one_pass else self.resync_draft)()
        else:  # the MTP's KV over the block's rows, m + 1 of them kept; its next first draft
            self._catch_up(k + 1, self.num_accepted + 1)
        self.current.copy_(self.predictions.index_select(1, self.num_accepted[None]))

    def _hidden_kept(self, out, row: int, rows: int) -> torch.Tensor:
        """A forward's logits; with an MTP drafter (whose forward returns the hidden states
        too) its first ``rows`` hidden states kept in the drafter's rows from ``row`` on."""
        if self.drafter is None:
            return out
        logits, hidden = out
        self.drafter.hidden[:, row:row + rows].copy_(hidden[:, :rows])
        return logits

    def _catch_up(self, rows: int, count) -> None:
        """The MTP drafter's KV over the ``rows`` rows just run from the snapshot's position
        (the block's or run's first; their tokens the exact model's predictions), ``count``
        of them kept."""
        self.drafter.tokens[:, :rows].copy_(self.predictions[:, :rows])
        self.drafter.count.copy_(count)
        self.drafter.catch_up(rows, self.snapshot.position)

    def _exact_run(self, n: int, sampled: bool) -> None:
        """n exact steps back to back, no drafts: a run of k = 0 blocks (drafts too poor to
        pay) in one graph and one host sync instead of n, as BF16-only decoding does its
        blocks. Each step feeds the token the step before predicted (``sampled``: drew from
        the exact model's warped distribution with the run's own uniforms); the snapshot is the
        state before the run (a stop inside it: the engine restores it and feeds what was
        kept)."""
        self.take_snapshot()
        forward = self.compiled or self.forward  # (the compiled one-row forward of k = 0)
        d = self.decoder
        for i in range(n):
            self.inputs[:, :1].copy_(self.current)
            logits = self._hidden_kept(forward(self.inputs[:, :1], self.cache, logits_to_keep=1),
                                       i, 1)
            if sampled:  # no drafts to check: a plain draw from the exact model
                self.predictions[:, i:i + 1].copy_(sample_from_logits(
                    logits[:, 0], d.temperature, d.top_k, d.top_p, self.u_run[i:i + 1],
                    d.min_p))
            else:
                self.predictions[:, i:i + 1].copy_(logits.argmax(dim=-1))
            self.current.copy_(self.predictions[:, i:i + 1])
        if self.drafter is None:
            self.resync_draft()
        else:
            self._catch_up(n, n)

    # --- a reply held to a grammar (unimax.held): the exact model's forward and choice ------
    # (the exact runs of a held reply where drafts do not pay, and every step with the
    # engine's held_drafts off; else it drafts, checked by masked blocks.) No snapshot and no
    # resync of the draft's cache (the engine bridges it before the next drafts, if any):
    # these steps never draft, and each token they emit is fed as the next forward (the
    # finish's feed of the last one included), so the exact cache is never rolled back. (Two copies
    # of the state a token saved: at 4B 67 MB each, read and written, ~0.9 ms on an L4's
    # 300 GB/s against a ~28 ms step.)

    def _held_forward(self) -> None:
        with pdl.auto_pdl(self.pdl_run or False, self.pdl_run_trigger):
            self.inputs[:, :1].copy_(self.current)
            forward = self.compiled or self.forward  # (the compiled one-row forward of k = 0)
            out = forward(self.inputs[:, :1], self.cache, logits_to_keep=1)
            logits = (out if self.drafter is None else out[0])[:, 0]
        self.held_logits = logits_buffer(logits, self.held_logits)
        self.held_logits.copy_(logits)

    def _held_choice(self, sampled: bool) -> None:
        self.current.copy_(choose(self.held_logits, self.decoder, self.u_run[:1], sampled))

    @torch.inference_mode()
    def capture_held(self, sampled: bool = False) -> None:
        """Capture the graphs of replies held to a grammar now (start-up), as ``capture``
        does the plain ones: the greedy blocks of every k >= 1 checked against the grammar's
        masks (``launch(k, masked=True)``; no new compilation: the blocks' forwards; k = 0 runs
        as held steps), and the held step's forward in each KV window, then its greedy choice
        (``sampled``: the sampled blocks and choice too)."""
        self.choose_pdl()
        writes = self._writes()
        windows = self.windows()
        for window in windows:
            with self.cache.attending(window):
                for (k, span), s in itertools.product(self._spans_met(window, windows),
                                                      (False, True) if sampled else (False,)):
                    if k == 0:
                        continue
                    self.runner.prepare(
                        self.graph_key(k, span, window, s, masked=True),
                        lambda k=k, span=span, s=s: self._verify(k, s, span, masked=True),
                        writes=writes, buffers=self._buffers())
                self.runner.prepare(("held", "forward", window), self._held_forward,
                                    writes=[self.cache])
        for s in (False, True) if sampled else (False,):
            self.runner.prepare(("held", "choice", s), lambda s=s: self._held_choice(s),
                                writes=[], buffers=self._buffers())

    @torch.inference_mode()
    def held_forward(self) -> None:
        """Feed ``current`` to the exact model; its logits wait in ``held_logits`` for
        ``held_choice``. No host sync (its graph captured by capture_held, else at first
        use)."""
        self.choose_pdl()  # (the one-token forwards' setting: exact runs')
        seen = self.cache.seen_tokens
        window = self.window_for(seen + 1)
        with self.cache.attending(window):
            self.runner.run(("held", "forward", window), self._held_forward, writes=[self.cache])
        self.cache.seen_tokens = seen + 1

    @torch.inference_mode()
    def held_choice(self) -> None:
        """The exact model's next token from the last held forward's logits, kept to the
        decoder's ``token_mask`` (loaded by the caller), into ``current``, and its copy to the
        host queued (``held_token.receive()`` reads it). No host sync."""
        if self.decoder.token_mask is None or self.held_logits is None:
            raise ValueError("a held choice needs the decoder's token_mask set and a "
                             "held_forward before it")
        sampled = not self.decoder.sampling.is_greedy
        if sampled:
            self.u_run[:1].uniform_(generator=self.decoder.generator)
        self.runner.run(("held", "choice", sampled), lambda: self._held_choice(sampled),
                        writes=[], buffers=self._buffers())
        self.held_token.send(self.current)

    def _buffers(self) -> list[torch.Tensor]:
        mine = [self.inputs, self.predictions, self.num_accepted, self.u_accept, self.u_final,
                self.u_run, self.current]
        d = self.drafter
        return mine if d is None else mine + [d.hidden, d.tokens, d.count, d.last,
                                              d.out_tokens]

    def _writes(self) -> list[RecurrentCache]:
        """The caches a verifier graph writes (its warm-ups restore them)."""
        return [self.cache, self.snapshot, self.decoder.cache] + (
            [] if self.drafter is None else [self.drafter.cache])

    # --- start-up and per block ----------------------------------------------------------

    @torch.inference_mode()
    def capture(self, sampled: bool = False) -> None:
        """Every verifier graph a reply can meet: each block length in each KV bucket, padded
        (``span``), and on hybrids unpadded in the last bucket, where the buffers' end can
        leave no room for the padding; exact runs of 2..block_size steps (``sampled``: the
        verified-sampling graphs too). The caches are left as they were."""
        self.choose_pdl()
        windows = self.windows()
        writes = self._writes()
        for window in windows:  # hybrid models: one set per KV bucket
            with self.cache.attending(window):
                for n, s in itertools.product(range(2, self.block_size + 1),
                                              (False, True) if sampled else (False,)):
                    self.runner.prepare(self.run_key(n, window, s),
                                        lambda n=n, s=s: self._exact_steps(n, s),
                                        writes=writes, buffers=self._buffers())
                for (k, span), s in itertools.product(self._spans_met(window, windows),
                                                      (False, True) if sampled else (False,)):
                    self.runner.prepare(self.graph_key(k, span, window, s),
                                        lambda k=k, s=s, span=span: self._verify(k, s, span),
                                        writes=writes, buffers=self._buffers())

    def _spans_met(self, window, windows) -> list[tuple[int, int]]:
        """(k, span) of every block a reply can meet in ``window``: each k padded (``span``),
        and on hybrids unpadded too in the last window, where the buffers' end can leave no
        room for the padding."""
        last = window == windows[-1] and self.cache.has_attention
        return [(k, span) for k in range(self.block_size + 1)
                for span in sorted({self.span(k, 0)} | ({k + 1} if last else set()))]

    @torch.inference_mode()
    def choose_pdl(self) -> None:
        """Where the kernel configuration's pdl is "auto", graphs are on, the forwards are
        compiled (their linears Triton kernels: ops.gemv's tensor-core GEMMs, the fused GEMVs of the
        one-token forward) and the GPU has programmatic dependent launch: capture the greedy block
        of block_size drafts, and the exact run of block_size steps, each plain and with PDL on
        every one of those kernels, signalled at each program's start and at its end (the first KV
        bucket), keep the fastest of each (graph.timed_pdl_choice) and capture every later graph in
        its kind's setting: blocks with drafts in ``pdl`` (``pdl_trigger``), one-token forwards
        (exact runs, k = 0 blocks) in ``pdl_run`` (``pdl_run_trigger``). Once per verifier (``pdl``
        None until then).

        Why: the verify block is what keeps 0.8B verified mode under BF16-only, 1.55-1.78 BF16
        steps for 9 rows on the H200 (4B: 1.30), its time per layer, not per byte; PDL made the
        0.8B decoders' blocks 6-8% faster (bench/RESULTS.md). Two choices,
        since the one-token forwards run the fused GEMVs, whose PDL made 4B steps slower and
        0.8B ones faster, and the blocks with drafts the tensor-core GEMMs. Measured so
       : the blocks keep plain launches at 0.8B and 4B (PDL 4-10%
        slower), the exact runs take PDL at 0.8B (7-8% faster) and not at 4B."""
        if self.pdl is not None:
            return
        self.pdl = self.pdl_run = False
        candidate = self.compiled is not None  # (eager forwards: cuBLAS, nothing to launch early)
        if not pdl_timable(candidate, self.runner):
            return
        window, k = self.windows()[0], self.block_size
        span = self.span(k, 0)
        writes = self._writes()

        def capture(key, body):
            with self.cache.attending(window):
                self.runner.prepare(key, body, writes=writes, buffers=self._buffers())

        def capture_block(setting, trigger):
            self.pdl, self.pdl_trigger = setting, trigger
            capture(self.graph_key(k, span, window, False), lambda: self._verify(k, False, span))

        def capture_run(setting, trigger):
            self.pdl_run, self.pdl_run_trigger = setting, trigger
            capture(self.run_key(k, window, False), lambda: self._exact_steps(k))

        signature = pdl_signature(self.model, k)
        self.pdl, self.pdl_trigger, self.pdl_ms = timed_pdl_choice(
            self.runner, self.graph_key(k, span, window, False), True, capture_block,
            ("verify",) + signature)
        if k > 1:  # (exact runs are 2..block_size steps)
            self.pdl_run, self.pdl_run_trigger, self.pdl_run_ms = timed_pdl_choice(
                self.runner, self.run_key(k, window, False), True, capture_run,
                ("exact run",) + signature)

    @staticmethod
    def graph_key(k: int, span: int, window, sampled: bool, masked: bool = False):
        """(block_costs_ms reads the plain greedy blocks' keys: four items)"""
        return ("verify", k, span, window) + (("sampled",) if sampled else ()) + \
            (("masked",) if masked else ())

    @staticmethod
    def run_key(steps: int, window, sampled: bool):
        return ("exact", steps, window) + (("sampled",) if sampled else ())

    def block_costs_ms(self) -> dict[int, float]:
        """k -> the measured replay time of a greedy block of k drafts where the buffers have
        room (the span a reply meets), the mean over KV buckets: the draft-length policy's
        verify costs. k = 0: per step of a greedy exact run of block_size steps where those
        were captured, since that is how the engine runs the k = 0 blocks the policy chooses
        (several to a graph, one snapshot and resync a run: unimax.engine), else the single
        step's block. Empty before capture (or without graphs)."""
        costs: dict[int, list[float]] = {}
        runs: list[float] = []
        for key, ms in self.runner.replay_ms.items():
            if key[0] == "verify" and len(key) == 4 and key[2] == self.span(key[1], 0):
                costs.setdefault(key[1], []).append(ms)
            elif key[0] == "exact" and len(key) == 3 and key[1] == self.block_size:
                runs.append(ms / self.block_size)
        if runs and 0 in costs:
            costs[0] = runs
        return {k: sum(v) / len(v) for k, v in costs.items()}

    def launch(self, k: int, sampled: bool = False, steps: int = 1,
               masked: bool = False) -> tuple[int, int, int]:
        """Queue the graph that checks the k drafts the decoder just wrote (k = 0: none;
        ``steps`` > 1, k = 0: an exact run of that many steps instead) and the copy of its
        result; no host sync. ``sampled``: speculative sampling (the decoder recorded its
        distributions; its sampling settings and seeded generator are the reply's).
        ``masked`` (a block): held to the grammar's masks in the decoder's ``token_mask`` table,
        loaded by the caller (sampled: the draft recorded its masked distributions; its graphs
        captured by capture_held, else at first use).
        Returns what ``collect`` needs."""
        self.choose_pdl()  # (before this verifier's first graph; once, a no-op without graphs)
        seen = self.cache.seen_tokens
        if steps > 1 and (k or steps > self.block_size):
            raise ValueError(f"an exact run is 2..{self.block_size} steps with no drafts; got "
                             f"k={k}, steps={steps}")
        run = steps > 1  # an exact run's form: its tokens are the predictions
        if masked and run:
            raise ValueError("a masked block is not an exact run")
        if sampled and run:  # drawn into the graph's own buffers: no temporary, no copy
            self.u_run[:steps].uniform_(generator=self.decoder.generator)
        elif sampled:
            self.u_accept[:k].uniform_(generator=self.decoder.generator)
            self.u_final.uniform_(generator=self.decoder.generator)
        writes = self._writes()
        if run:
            window = self.window_for(seen + steps)
            with self.cache.attending(window):
                self.runner.run(self.run_key(steps, window, sampled),
                                lambda: self._exact_steps(steps, sampled),
                                writes=writes, buffers=self._buffers())
            parts = [self.num_accepted[None], self.predictions[0, :steps]]
        else:
            # The verifier's forward ends at seen + span: it reads the KV bucket holding that
            # many entries (its graphs are keyed by it; None: pure GDN).
            span = self.span(k, seen)
            window = self.window_for(seen + span)
            with self.cache.attending(window):
                self.runner.run(self.graph_key(k, span, window, sampled, masked),
                                lambda: self._verify(k, sampled, span, masked),
                                writes=writes, buffers=self._buffers())
            # (the drafts as this block fed them: an MTP drafter's catch-up has already
            # written the next block's first draft where they were read)
            parts = [self.num_accepted[None], self.inputs[0, 1:k + 1],
                     self.predictions[0, :k + 1]]
        self.snapshot.seen_tokens = seen  # Python bookkeeping is not part of the graph
        size = sum(int(t.numel()) for t in parts)
        torch.cat(parts, out=self.result[:size])
        self.result_host[:size].copy_(self.result[:size], non_blocking=True)
        if self.result_ready is not None:
            self.result_ready.record()
        return seen, k, steps if run else 0

    def collect(self, launched: tuple[int, int, int], counts: VerifyCounts) -> list[int]:
        """Wait for a launched block's result (not for work queued after it), account for it
        (an exact run as that many k = 0 blocks) and return the tokens it emits: the kept
        drafts and the exact model's token after them, or the run's tokens. One host sync."""
        seen, k, steps = launched  # (steps 0: a block; else an exact run's)
        if self.result_ready is not None:
            self.result_ready.synchronize()
        if steps:
            exact = self.result_host[1:steps + 1].tolist()
            counts.verifier_blocks += steps
            self.cache.seen_tokens = self.decoder.cache.seen_tokens = seen + steps
            return exact
        host = self.result_host[:2 * k + 2].tolist()
        m, draft, exact = host[0], host[1:k + 1], host[k + 1:]
        counts.drafted += k
        counts.verifier_blocks += 1
        counts.accepted += m
        counts.rejected_blocks += m < k
        # (the graph rolled the caches back to m + 1 inputs and set the next first token)
        self.cache.seen_tokens = self.decoder.cache.seen_tokens = seen + m + 1
        return draft[:m] + [exact[m]]
