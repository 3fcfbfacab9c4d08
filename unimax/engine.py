"""UniMaxEngine: exact prefill, the O(1) bridge, fast decoding and verified-exact decoding.

Modes:
- fast: the exact first token, then the decode graph (BF16, or the FP8 state-safe tail);
- verified: per block, the draft graph proposes k tokens and the verifier (unimax.verifier)
  checks them with one exact forward, keeps the agreeing prefix and the exact token after it;
  the exact cache stays authoritative and the draft's cache is resynced from it after a
  rejection (after every block for the ``full`` draft).
A reply held to a grammar (``generate``'s ``constraint``) decodes one token at a time, its mask
applied before each choice, the host's turn behind the next forward (unimax.held): the
decoder's in fast mode (``_held_loop``); in verified mode the draft's, under the grammar, each
block checked against the grammar's masks (``_held_verified_loop``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .cache import CacheCopier, cache_payload_bytes
from .draft_length import DraftLength
from .exact import ExactSide
from .graph import MaxTurboGraphDecoder
from .held import HostTurns
from .kernels import KernelConfig, active, using
from .penalties import PenaltySettings
from .sampling import SamplingParams, sample_from_logits
from .token_mask import NoGrammar, TokenMask
from .verifier import Verifier, VerifyCounts


@dataclass(frozen=True)
class BridgeReport:
    seconds: float
    mib: float
    seen_tokens: int


@dataclass(frozen=True)
class VerifyReport:
    generated_tokens: int
    drafted_tokens: int
    accepted_draft_tokens: int
    rejected_blocks: int
    verifier_blocks: int

    @property
    def acceptance_rate(self) -> float:
        if self.drafted_tokens <= 0:
            return 1.0
        return self.accepted_draft_tokens / self.drafted_tokens

    @property
    def mean_draft_length(self) -> float:
        """Drafts per verified block (the draft-length policy's choices; 0: exact steps)."""
        return self.drafted_tokens / max(self.verifier_blocks, 1)


# Prompt tokens per prefill forward (prefill_exact): bounds its memory (a 16k chunk's
# activations are a few hundred MB at 0.8B, ~2 GB at 4B). 16k rather than 8k: on the H200 a
# 16k-token prompt took 98 ms in one chunk against 114-134 in two (bench/RESULTS.md,
# 2026-11-30), mostly attention: a chunk on kept KV attends through the
# bottom-right causal bias, which only the flash kernel takes (2.9 ms per layer at 8k over
# 16k keys, where cuDNN's causal kernel did the first chunk's 8k in 0.5).
PREFILL_CHUNK = 16384


@dataclass
class Generation:
    """What one ``generate`` call produced and what it cost."""

    tokens: list[int] = field(default_factory=list)
    stopped: str = "length"  # "length", "stop" (a stop id was emitted) or "cancelled"
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # first token emitted -> last token emitted
    finish_seconds: float = 0.0  # bringing the exact state up to the reply (see _finish)
    bridge: BridgeReport | None = None
    verify: VerifyReport | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_force(method):
    """The engine's kernel configuration (``self.kernels``) in force on this thread while
    ``method`` runs: what its graphs capture, its views fold and its ops launch."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with using(self.kernels):
            return method(self, *args, **kwargs)
    return call


class UniMaxEngine:
    """Phase-specialized recurrent inference. ``exact_model`` always prefills and verifies;
    ``decode_model`` is the same model (BF16 only) or a quantized view sharing its weights."""

    def __init__(self, exact_model, decode_model, decode_graph: MaxTurboGraphDecoder,
                 state_safe_draft: bool = True, compile_verifier: bool = False,
                 exact: ExactSide | None = None, kernels: KernelConfig | None = None,
                 drafter=None):
        """``exact``: the exact side this engine shares with other modes' engines (its cache,
        KV buffers and prefill graphs: unimax.exact); by default one of its own. ``kernels``:
        the kernel configuration in force while any of this engine's calls runs
        (unimax.kernels; build_engine passes the one it built with; default: the one in force
        now). ``drafter``: verified mode's MTP drafter (unimax.mtp_draft) in place of the
        decoder's drafts."""
        self.kernels = kernels or active()
        self.mtp_draft = drafter
        # a prompt's last hidden state, waiting for the token after it (the MTP drafter's row)
        self._mtp_pending: tuple[torch.Tensor, int] | None = None
        if exact is None:
            exact = ExactSide(exact_model, use_graphs=decode_graph.use_graphs)
        elif exact.model is not exact_model:
            raise ValueError("the shared exact side holds another model than exact_model")
        self.exact = exact
        self.exact_model = exact.model
        self.decode_model = decode_model.eval()
        self.decode_graph = decode_graph
        self.device = exact.device
        if self.device != self.decode_graph.device:
            raise ValueError("exact and decode engines must live on the same device")
        # False for the full-FP8 draft, whose states drift: it may draft, never decode alone.
        self.state_safe_draft = state_safe_draft
        self.exact_cache = exact.cache
        # Hybrid models: both engines run the same attention weights, so the KV the exact
        # prefill writes is what the decoder needs: share the buffers, bridge only the
        # fixed-size state (and the position). Rejections roll KV back by position alone.
        decode_graph.cache.share_kv_with(self.exact_cache)
        self.last_bridge: BridgeReport | None = None
        # A fixed cache pair, validated once; each copy is then one fused launch.
        self.bridge_copy = CacheCopier(decode_graph.cache, self.exact_cache)
        # built at verified mode's first use (``verifier``): a fast mode's engine needs none
        self._verifier: Verifier | None = None
        self.compile_verifier = compile_verifier
        # Queue each verified block's drafts before the host has read the block before (the
        # GPU drafts while the host streams); False: draft after reading, as the plain loop.
        self.pipelined = True
        # Verified blocks draft as many tokens as pay (calibrated by capture_graphs).
        self.draft_length = DraftLength(self.block_size)
        self.prefill_chunk = PREFILL_CHUNK
        # A reply held to a grammar: its mask, applied inside the decoder's and the verifier's
        # one-token graphs (generate's ``constraint``)
        decode_graph.token_mask = TokenMask(self.exact_model.config.vocab_size, self.device,
                                            rows=decode_graph.block_size + 1)
        # Queue each held token's forward before the host reads the token (unimax.held); False:
        # forward after reading it, the host's turn between the GPU's steps (the A/B in
        # bench/structured.py)
        self.held_ahead = True
        # Verified mode's replies held to a grammar draft under it and verify each block with
        # the grammar's masks (``_held_verified_loop``); False: exact steps only
        self.held_drafts = drafter is None  # (MTP drafts are not held to a grammar yet)
        # what such blocks' host turns add to their graphs' time, learned (unimax.held)
        self.held_host = HostTurns()
        # short prompts through the exact side's captured graphs (with graphs only)
        self.short_prefill = exact.short_prefill if decode_graph.use_graphs else None

    @property
    def verifier(self) -> Verifier:
        """Verified mode's checker of this engine's drafts (unimax.verifier), built at first
        use: its snapshot cache, tape and compiled forwards cost memory and start-up time that
        a fast mode never needs."""
        if self._verifier is None:  # (built under this engine's kernel configuration; the
            # property is read on every block, so only the build enters it)
            with using(self.kernels):
                self._verifier = Verifier(self.exact_model, self.exact_cache, self.decode_graph,
                                          self.bridge_copy, compile=self.compile_verifier,
                                          drafter=self.mtp_draft)
        return self._verifier

    @property
    def block_size(self) -> int:
        return self.decode_graph.block_size

    @in_force
    @torch.inference_mode()
    def reset(self) -> None:
        self.exact_cache.reset()
        self.decode_graph.reset()
        self.last_bridge = None

    # --- the seed's API -----------------------------------------------------------------

    @torch.inference_mode()
    def _bridge(self) -> BridgeReport:
        """Copy the exact recurrent state into the decoder's cache (addresses kept)."""
        _sync(self.device)
        start = time.perf_counter()
        self.bridge_copy()
        _sync(self.device)
        report = BridgeReport(seconds=time.perf_counter() - start,
                              mib=cache_payload_bytes(self.exact_cache) / 2**20,
                              seen_tokens=int(self.exact_cache.seen_tokens))
        self.last_bridge = report
        return report

    @in_force
    @torch.inference_mode()
    def prefill_exact(self, input_ids: torch.Tensor, keep_state: bool = False,
                      on_progress: Callable[[int, int], bool] | None = None):
        """Exact prefill (from a fresh state, or on top of the kept one), argmax first token,
        bridge. Returns (first_token (1, 1), output, BridgeReport), or None when
        ``on_progress(done, total)`` (called after each chunk of ``prefill_chunk`` tokens)
        returned False: cancelled, the exact cache part-way through the prompt.

        A long prompt goes in chunks, each on top of the state the last one left (the GDN
        state and the KV written so far): memory stays that of one chunk at any length, and a
        chat can show progress and cancel between chunks. The result is the state one forward
        over the whole prompt gives, to rounding."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"UNI MAX engines run batch size 1: input_ids must have shape "
                             f"(1, T), got {tuple(input_ids.shape)}")
        if not keep_state:
            self.exact_cache.reset()
            self._mtp_pending = None
        self.decode_graph.set_sampling(None)  # greedy unless generate() samples this reply
        total = int(input_ids.shape[1])
        if total == 0:
            raise ValueError("input_ids is empty: the prompt needs at least one token")
        short = self.short_prefill if self.mtp_draft is None else None  # (MTP: every h)
        if short is not None and total <= self.prefill_chunk and short.bucket(total):
            # a chat turn: one captured graph instead of hundreds of launches (short_prefill.py)
            self.exact_model.check_input_ids(input_ids)
            self.exact_model.check_room(self.exact_cache, total)
            out = short(input_ids)
        else:
            for start in range(0, total, self.prefill_chunk):
                piece = input_ids[:, start:start + self.prefill_chunk]
                at = self.exact_cache.seen_tokens
                out = self.exact_model(input_ids=piece, past_key_values=self.exact_cache,
                                       use_cache=True, logits_to_keep=1,
                                       return_hidden=self.mtp_draft is not None)
                if self.mtp_draft is not None:
                    self._mtp_rows(out.hidden, piece, at)
                done = min(start + self.prefill_chunk, total)
                if on_progress is not None and not on_progress(done, total) and done < total:
                    return None
        first = torch.argmax(out.logits[:, -1, :], dim=-1, keepdim=True)
        bridge = self._bridge()
        self.decode_graph.static_token.copy_(first)
        return first, out, bridge

    def _mtp_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, at: int) -> None:
        """A prompt chunk's rows (its hidden states, from position ``at``) through the MTP
        drafter, each with the token after it; the chunk's last waits for its token (the next
        chunk's first, or the reply's first: ``_mtp_first``)."""
        if self._mtp_pending is not None:
            self._mtp_first(tokens[:, :1])
        if hidden.shape[1] > 1:
            self.mtp_draft.prefill(hidden[:, :-1], tokens[:, 1:], at)
        self._mtp_pending = (hidden[:, -1:].clone(), at + hidden.shape[1] - 1)

    def _mtp_first(self, token: torch.Tensor) -> None:
        """The waiting last row with the token after it: the MTP drafter's first draft."""
        if self.mtp_draft is not None and self._mtp_pending is not None:
            hidden, at = self._mtp_pending
            self.mtp_draft.prefill(hidden, token.reshape(1, 1), at)
            self._mtp_pending = None

    @in_force
    @torch.inference_mode()
    def decode_fast(self, first_token: torch.Tensor, recurrent_forwards: int) -> torch.Tensor:
        return self.decode_graph.decode_forwards(first_token, int(recurrent_forwards))

    @in_force
    @torch.inference_mode()
    def generate_fast(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Exact first token, then graph tokens. (1, max_new_tokens)."""
        n = _count(max_new_tokens)
        if n == 0:
            return torch.empty((input_ids.shape[0], 0), dtype=torch.long, device=input_ids.device)
        first, _, _ = self.prefill_exact(input_ids)
        if n == 1:
            return first
        return torch.cat([first, self.decode_graph.decode_tokens(first, n - 1)], dim=1)

    @in_force
    @torch.inference_mode()
    def decode_verified(self, first_token: torch.Tensor, recurrent_forwards: int, *,
                        draft_block: int | None = None) -> tuple[torch.Tensor, VerifyReport]:
        """Verify ``recurrent_forwards`` tokens after ``first_token``; ``prefill_exact`` must
        have run just before, so both caches hold the same state. ``draft_block``: drafts per
        block (1..block_size); None lets the draft-length policy choose per block (after
        ``capture_graphs`` has timed the graphs; before, every block drafts block_size)."""
        n = _count(recurrent_forwards)
        if first_token.shape[0] != 1:
            raise ValueError("verified decoding supports batch size 1 only")
        if n == 0:
            return (torch.empty((1, 0), dtype=torch.long, device=self.device),
                    VerifyReport(0, 0, 0, 0, 0))
        tokens: list[int] = []
        counts = VerifyCounts()
        self.verifier.current.copy_(first_token)
        self._mtp_first(first_token)
        for emitted in self._verified_blocks(n, _block_arg(draft_block, self.block_size),
                                             counts):
            tokens.extend(emitted)
        out = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return out, _report(len(tokens), counts)

    @in_force
    @torch.inference_mode()
    def generate_verified(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                          draft_block: int | None = None) -> tuple[torch.Tensor, VerifyReport]:
        """Exact greedy tokens, drafted fast and checked exactly. (1, max_new_tokens)."""
        n = _count(max_new_tokens)
        if n == 0:
            return (torch.empty((input_ids.shape[0], 0), dtype=torch.long,
                                device=input_ids.device), VerifyReport(0, 0, 0, 0, 0))
        if input_ids.shape[0] != 1:
            raise ValueError("verified decoding supports batch size 1 only")
        first, _, _ = self.prefill_exact(input_ids)
        if n == 1:
            return first, VerifyReport(1, 0, 0, 0, 0)
        tail, report = self.decode_verified(first, n - 1, draft_block=draft_block)
        full = torch.cat([first, tail], dim=1)
        return full, VerifyReport(int(full.shape[1]), report.drafted_tokens,
                                  report.accepted_draft_tokens, report.rejected_blocks,
                                  report.verifier_blocks)

    @in_force
    @torch.inference_mode()
    def capture_graphs(self, verified: bool = True, sampled: bool = False) -> None:
        """Capture every graph a reply can meet (decode blocks of each size; for verified
        mode the verifier of each block size and the rewind of each length; the held steps and
        masked blocks of a reply held to a grammar; ``sampled``: the sampling variants too) at
        start-up. The caches are left as they were. A no-op without graphs."""
        self.decode_graph.capture_blocks()  # greedy blocks: every reply may meet them
        if sampled:
            self.decode_graph.capture_blocks(sampled=True)
        if self.short_prefill is not None:
            self.short_prefill.capture()
        if verified:
            if sampled:
                self.decode_graph.capture_blocks(record=True)
            self.verifier.capture(sampled=sampled)
            if self.decode_graph.use_graphs:
                self._calibrate_draft_length()
        # held replies: fast mode's steps, verified mode's drafts (sampled: recording their
        # distributions) and its verifier's
        self.decode_graph.capture_held(sampled and not verified, record=sampled and verified)
        if verified:
            self.verifier.capture_held(sampled)

    def _calibrate_draft_length(self) -> None:
        """The draft-length policy's costs: the captured graphs' own replay times."""
        decoded = self.decode_graph.runner.replay_ms
        if any((k, False) not in decoded for k in range(1, self.block_size + 1)):
            return  # not every draft block was captured: stay uncalibrated (k = block_size)
        # (the rollback runs inside each verify graph: its cost is in verify_ms)
        self.draft_length.calibrate(
            draft_ms={k: decoded[(k, False)] for k in range(1, self.block_size + 1)},
            verify_ms=self.verifier.block_costs_ms(), rewind_ms=0.0)

    def _verified_blocks(self, n: int, k_max: int | None, counts: VerifyCounts):
        """Yields the tokens each block emits (list of ints). One host sync per block. Each
        block drafts k_max tokens, or (k_max None) what the draft-length policy chooses. With
        the decoder's sampling on (set_sampling), blocks are checked by speculative sampling."""
        graph = self.decode_graph
        sampled = not graph.sampling.is_greedy
        if sampled and graph.sampling.seed is not None and k_max is None:
            # Which tokens a seed draws depends on where the blocks are cut (a draft's uniform
            # or a bonus token's), and the policy's running acceptance is what earlier replies
            # left: a seeded reply starts from the prior, so the same seed, prompt and state
            # give the same text again in this app. (Across restarts the graphs' measured times
            # may tip a close choice; a fixed draft_block reproduces everywhere.)
            self.draft_length.forget()
        policy = self.draft_length

        def pick(left: int) -> tuple[int, int, int]:
            """The draft length of a block that may emit up to ``left`` tokens (a block emits
            at most k + 1: the verifier never writes KV past the context the caller checked),
            the policy's probe state for it, and its exact steps: where the policy falls back
            to k = 0, up to block_size of them in one graph until its next probe."""
            if sampled and self.mtp_draft is not None:  # (greedy MTP drafts: exact runs)
                return 0, 0, min(left, self.block_size)
            if k_max is None:
                k = policy.choose(left)
                probe = policy.probe
                steps = 1
                if k == 0 and not probe:
                    steps = policy.exact_run(min(left, self.block_size))
                return k, probe, steps
            return min(k_max, left - 1), 0, 1

        def draft(k: int) -> None:
            if k and self.mtp_draft is not None:  # (its first draft: the last block's)
                self.mtp_draft.run_block(k)
            elif k:
                graph.static_token.copy_(self.verifier.current)
                graph.run_block(k, record=sampled)

        remaining = n
        k, probe, steps = pick(remaining)
        draft(k)
        while True:
            checking = self.verifier.launch(k, sampled, steps)
            ahead = None
            most = k + 1 if k else steps  # tokens this block may emit
            if self.pipelined and remaining - most >= 1:
                # The next block's drafts are queued now, behind this block's check, so the GPU
                # drafts while the host reads this block: they read only what its graph leaves
                # on the device (the next first token, the resynced draft state), and their
                # length is chosen for the fewest tokens that can be left. If this block turns
                # out to be the last (a stop id, a cancel) they are never read: they wrote only
                # the draft's cache and KV past the exact position, which nothing reads.
                ahead = pick(remaining - most)
                draft(ahead[0])
            emitted = self.verifier.collect(checking, counts)
            policy.probe = probe  # (the choice for the block ahead moved it on)
            for _ in range(steps):  # (an exact run: that many k = 0 blocks)
                policy.observe(k, len(emitted) - 1 if k else 0)
            remaining -= len(emitted)
            yield emitted
            if remaining <= 0:
                return
            if ahead is None:
                ahead = pick(remaining)
                draft(ahead[0])
            k, probe, steps = ahead

    # --- chat-facing generation: streaming, stop ids, state kept for the next turn ----------

    @in_force
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, mode: str = "fast",
                 stop_ids: Iterable[int] = (), sampling: SamplingParams | None = None,
                 keep_state: bool = False, draft_block: int | None = None,
                 on_block: Callable[[list[int]], bool] | None = None,
                 on_prefill: Callable[[int, int], bool] | None = None,
                 checkpoint: tuple[int, Callable[[], None]] | None = None,
                 constraint=None, penalties: PenaltySettings | None = None,
                 penalized_prompt: list[int] | None = None) -> Generation:
        """Generate up to ``max_new_tokens`` after ``input_ids`` (new tokens on top of the kept
        state when ``keep_state``). ``on_block(tokens)`` sees each block's tokens as they are
        decided; returning False cancels after that block. Generation stops after a stop id.
        Afterwards the exact cache holds the state after the input and every emitted token,
        and nothing decoded past the stop, so a chat continues from it. ``draft_block``: as in
        ``decode_verified``. ``on_prefill(done, total)``: progress through a long prompt (see
        ``prefill_exact``); returning False cancels before any token (stopped "cancelled", no
        tokens, and the exact cache holds no state worth keeping). ``checkpoint=(k, keep)``:
        the prefill stops after the first k of ``input_ids`` (k = all of them: after the
        prefill, before any reply token) for ``keep()`` to copy the exact cache there, then goes
        on (the service keeps a chat's state where the chat template's later turns stop
        matching this prompt). ``constraint``: a ``structured.Constraint`` every token keeps
        to (``_held``: each token masked before it is chosen; behind an open thinking block,
        from the token after it). ``penalties`` (unimax.penalties): a reply with presence,
        frequency or repetition penalties takes the held path too (without a grammar, every
        token allowed), from its first token; ``penalized_prompt``: the prompt's token ids the
        repetition penalty counts (default ``input_ids``; the service passes the whole
        conversation where the kept state holds part of it). Not with a grammar behind an
        open thinking block (the service refuses that request)."""
        penalized = penalties is not None and penalties.active
        if penalized and constraint is not None and not constraint.active:
            raise ValueError("penalties and a grammar behind a thinking block: not served")
        if penalized and constraint is None:
            constraint = NoGrammar()
        if mode not in ("fast", "verified"):
            raise ValueError(f"unknown mode {mode!r}; use 'fast' or 'verified'")
        if mode == "fast" and not self.state_safe_draft:
            raise ValueError("this engine's decoder is the full-FP8 draft, whose states drift: "
                             "use it in verified mode, or build the engine with draft='tail'")
        n = _count(max_new_tokens)
        if n < 1:  # no reply means no prefill: the cache would not hold this request's state
            raise ValueError(f"max_new_tokens must be >= 1, got {n}")
        sampling = sampling or SamplingParams()
        stops = set(int(s) for s in stop_ids)
        if self.exact_cache.has_attention:  # the KV buffers hold max_context tokens
            total = (self.exact_cache.seen_tokens if keep_state else 0) + \
                int(input_ids.shape[1]) + n
            limit = self.exact_model.config.max_context
            if total > limit:
                raise ValueError(f"prompt and reply would reach {total} tokens, over this "
                                 f"model's context of {limit} (max_context): fewer new tokens, "
                                 "a new conversation, or a larger max_context")
        result = Generation(prefill_tokens=int(input_ids.shape[1]))
        self.current_generation = result  # readable from on_block: prefill stats come early
        _sync(self.device)
        start = time.perf_counter()
        state_before = self.exact_cache.seen_tokens if keep_state else 0
        self._mtp_pending = None  # (a kept state's last hidden state was never seen)
        prefilled = self._prefill(input_ids, keep_state, on_prefill, checkpoint)
        if prefilled is None:
            result.stopped = "cancelled"
            result.prefill_seconds = time.perf_counter() - start
            return result
        first, out, result.bridge = prefilled
        self.decode_graph.set_sampling(None if sampling.is_greedy else sampling)
        if constraint is not None:  # (the held path's penalties: neutral for a grammar alone)
            prompt = [] if not penalized else input_ids[0].tolist() \
                if penalized_prompt is None else penalized_prompt
            self.decode_graph.token_mask.penalties.start(penalties if penalized else None,
                                                         prompt)
        if constraint is not None or not sampling.is_greedy:  # (else prefill_exact's argmax)
            first = self._first_token(out.logits[:, -1], constraint)
        self.decode_graph.static_token.copy_(first)
        if mode == "verified":
            self._mtp_first(first)  # (the MTP drafter's first draft: after the reply's token)
        result.prefill_seconds = time.perf_counter() - start - result.bridge.seconds
        start = time.perf_counter()
        # A grammar behind an open thinking block (``constraint`` not yet active) holds from
        # the token after the block's end: until then the reply decodes as any other, in
        # blocks (verified mode: drafted and checked), and ``_emit`` ends a block at the token
        # that closes the thinking (the constraint's ``opens``).
        thinking = constraint is not None and not constraint.active
        held = constraint is not None and constraint.active
        if self._emit(result, [int(first)], stops, n, on_block, constraint):
            if held:
                self._held(result, stops, n, on_block, mode, constraint)
            elif mode == "fast":
                self._fast_loop(result, stops, n, on_block, constraint)
            else:
                self._verified_loop(result, stops, n, draft_block, on_block, constraint)
        if thinking and constraint.active and result.stopped == "length" and \
                len(result.tokens) < n:
            held = True
            self._hold_after_thinking(result, mode, state_before, stops, n, on_block,
                                      constraint)
        _sync(self.device)
        result.decode_seconds = time.perf_counter() - start
        start = time.perf_counter()
        # (a held reply's verified blocks and exact runs leave the exact cache fed but the
        # last token, as its held steps do: the finish feeds what it has not)
        self._finish(result, mode, state_before, held=held)
        _sync(self.device)
        result.finish_seconds = time.perf_counter() - start
        return result

    def _prefill(self, input_ids, keep_state, on_prefill, checkpoint):
        """``prefill_exact``, in two parts around a checkpoint when one is asked for: the
        second goes on from the state the first left, as chunks do."""
        total = int(input_ids.shape[1])
        if checkpoint is None or not 0 < checkpoint[0] <= total:
            return self.prefill_exact(input_ids, keep_state=keep_state, on_progress=on_prefill)
        k, keep = checkpoint
        if k == total:  # the state after the whole prompt, before any reply token
            prefilled = self.prefill_exact(input_ids, keep_state=keep_state,
                                           on_progress=on_prefill)
            if prefilled is not None:
                keep()
            return prefilled
        # progress between the first part's chunks only: its end is no news to a user
        progress = None if on_prefill is None else \
            (lambda done, part: done == part or on_prefill(done, total))
        if self.prefill_exact(input_ids[:, :k], keep_state=keep_state,
                              on_progress=progress) is None:
            return None
        keep()
        progress = None if on_prefill is None else (lambda done, _: on_prefill(k + done, total))
        return self.prefill_exact(input_ids[:, k:], keep_state=True, on_progress=progress)

    def _first_token(self, logits: torch.Tensor, constraint) -> torch.Tensor:
        """The token (1, 1) the exact ``logits`` (1, vocab) choose: held to ``constraint``'s
        grammar where it is active, drawn where the decoder samples (set_sampling), else
        argmax."""
        if constraint is not None:
            self.decode_graph.token_mask.load(constraint)
            logits = self.decode_graph.token_mask.apply(logits)
        graph = self.decode_graph
        if graph.sampling.is_greedy:
            return logits.argmax(dim=-1, keepdim=True)
        uniform = torch.rand(1, generator=graph.generator, device=self.device)
        return sample_from_logits(logits, graph.temperature, graph.top_k, graph.top_p, uniform,
                                  graph.min_p)

    @staticmethod
    def _emit(result: Generation, tokens: list[int], stops: set[int], n: int,
              on_block, constraint=None) -> bool:
        """Append a block's tokens up to a stop id or the length limit, each fed to
        ``constraint`` (a grammar's, or its thinking block's watch) first; False when done, or
        when the constraint became active at one of them (the thinking block closed: the
        block ends there, the grammar holds from the next token)."""
        tokens = tokens[: n - len(result.tokens)]
        opened = False
        for i, token in enumerate(tokens):
            if constraint is not None:
                was = constraint.active
                constraint.accept(token)
                opened = constraint.active and not was
            if token in stops or opened:
                tokens = tokens[: i + 1]
                if token in stops:
                    result.stopped = "stop"
                break
        result.tokens.extend(tokens)
        if on_block is not None and tokens and on_block(tokens) is False:
            if result.stopped != "stop":
                result.stopped = "cancelled"
            return False
        return not opened and result.stopped != "stop" and len(result.tokens) < n

    def _fast_loop(self, result, stops, n, on_block, constraint=None) -> None:
        graph = self.decode_graph
        while len(result.tokens) < n:
            k = min(self.block_size, n - len(result.tokens))
            block = graph.run_block(k).tolist()[0]  # the block's one host sync
            if not self._emit(result, block, stops, n, on_block, constraint):
                return

    def _verified_loop(self, result, stops, n, draft_block, on_block, constraint=None) -> None:
        self.verifier.current.fill_(result.tokens[-1])
        counts = VerifyCounts()
        k_max = _block_arg(draft_block, self.block_size)
        try:
            for emitted in self._verified_blocks(n - len(result.tokens), k_max, counts):
                if not self._emit(result, emitted, stops, n, on_block, constraint):
                    break
        finally:
            result.verify = _report(len(result.tokens), counts)

    def _hold_after_thinking(self, result, mode, state_before, stops, n, on_block,
                             constraint) -> None:
        """The thinking block closed at the reply's last token, maybe inside a block whose
        later tokens were dropped (``_emit``): bring the exact cache to the reply so far but
        that token (the finish's feed), and go on held from it, as from any last token not
        yet fed (fast mode: the exact state bridged to the decoder, whose held step feeds
        it)."""
        self._finish(result, mode, state_before, last_unfed=True)
        self.bridge_copy()  # (verified mode's drafts go on from it too)
        self.decode_graph.static_token.fill_(result.tokens[-1])
        self._held(result, stops, n, on_block, mode, constraint)

    def _drafts_held(self, mode: str) -> bool:
        """Whether a held reply in ``mode`` drafts under its grammar (verified)."""
        return mode == "verified" and self.held_drafts

    def _held(self, result, stops, n, on_block, mode, constraint) -> None:
        self.decode_graph.token_mask.penalties.add(result.tokens)  # (its first token)
        if self._drafts_held(mode):
            self._held_verified_loop(result, stops, n, on_block, constraint)
        else:
            self._held_loop(result, stops, n, on_block, mode, constraint)

    def _held_verified_loop(self, result, stops, n, on_block, constraint) -> None:
        """Verified mode's reply held to a grammar, in blocks: the draft proposes k tokens one
        held step at a time, each chosen under the grammar's mask for it (the matcher takes
        each draft before it fills the next mask; the next draft's forward is queued before
        the host reads the draft, as in ``_held_loop``), every mask also a row of the mask
        table; the verifier checks the block with each position's exact prediction held to
        its row (``Verifier.launch(k, masked=True)``), so the block emits the exact model's
        greedy tokens under the grammar (sampled: each draft's masked distribution recorded,
        the speculative rule on the masked exact ones, so each token is distributed as the
        exact model's under the grammar); the matcher takes back the drafts not kept and takes
        the exact token after them. k from the draft-length policy, its costs plus the host's
        turns (``held_host``, learned from these blocks' wall time): where drafts do not pay
        (a short step: the demo model, 0.8B on an H100), k = 0 runs as an exact run of held
        steps (``_held_steps``, the verifier's) until the policy's next probe. A seeded
        sampled reply starts the policy from its prior and leaves the host's turns out (their
        wall-clock times would move where blocks are cut, so which tokens the seed draws), as
        ``_verified_blocks`` does."""
        policy, host = self.draft_length, self.held_host
        sampling = self.decode_graph.sampling
        sampled = not sampling.is_greedy
        if sampled and sampling.seed is not None:
            policy.forget()
            host = None
        counts = _counts(result.verify)
        self.verifier.current.fill_(result.tokens[-1])
        stale = False  # the draft's cache behind the exact one (after an exact run)
        try:
            while len(result.tokens) < n:
                left = n - len(result.tokens)
                k = policy.choose(left, extra=host)
                began = time.perf_counter()
                if k == 0 and not policy.probe:
                    # an exact run up to the next probe, each token emitted as it comes
                    going = self._held_steps(self.verifier, policy.exact_run(left), result,
                                             stops, n, on_block, constraint, counts)
                    ran = len(result.tokens) - (n - left)
                    for _ in range(ran):  # (each step a k = 0 block to the policy)
                        policy.observe(0, 0)
                    if policy.calibrated and host is not None:
                        host.observe(0, ran, 1e3 * (time.perf_counter() - began),
                                     ran * policy.verify_ms[0])
                    stale = True
                    if not going:
                        return
                    continue
                if stale:  # (the exact cache fed the run's tokens, the draft's did not)
                    self.bridge_copy()
                    stale = False
                emitted, k = self._held_block(k, stops, constraint, counts, sampled)
                self.decode_graph.token_mask.penalties.add(emitted)
                policy.observe(k, len(emitted) - 1)
                if policy.calibrated and k and host is not None:
                    host.observe(k, k, 1e3 * (time.perf_counter() - began),
                                 policy.draft_ms[k] + policy.verify_ms[k] + policy.host_ms)
                if not self._emit(result, emitted, stops, n, on_block):
                    return
        finally:
            result.verify = _report(len(result.tokens), counts)

    def _held_block(self, k: int, stops, constraint, counts,
                    sampled: bool = False) -> tuple[list[int], int]:
        """One verified block of up to k drafts under the grammar (``_held_verified_loop``):
        its tokens, and how many drafts ran (they end early at a stop id: a finished grammar
        takes no more). ``sampled``: checked by the speculative rule."""
        graph, verifier, mask = self.decode_graph, self.verifier, self.decode_graph.token_mask
        drafts: list[int] = []
        if k:
            graph.static_token.copy_(verifier.current)
            graph.held_forward()
        for i in range(k):
            mask.penalties.row(i, drafts[-1] if i else None)
            mask.load(constraint, row=i)
            graph.held_choice(record=sampled)
            graph.keep_draft(i, record=sampled)
            if i + 1 < k:
                graph.held_forward()
            drafts.append(graph.held_token.receive())
            constraint.accept(drafts[-1])
            if drafts[-1] in stops:
                break
        k = len(drafts)
        mask.penalties.row(k, drafts[-1] if k else None)
        mask.load(None if drafts and drafts[-1] in stops else constraint, row=k)
        emitted = verifier.collect(verifier.launch(k, sampled, masked=True), counts)
        constraint.rollback(k - (len(emitted) - 1))
        if not any(t in stops for t in emitted[:-1]):
            constraint.accept(emitted[-1])
        return emitted, k

    def _held_loop(self, result, stops, n, on_block, mode, constraint) -> None:
        """A reply held to a grammar, one token at a time (``_held_steps``). Fast mode steps
        the decoder; verified mode (``held_drafts`` off; else ``_held_verified_loop``) the
        exact model through the verifier, no drafts. One host sync per token, as the exact
        eager path had, but each step is two graphs instead of hundreds of launches."""
        counts = None if mode == "fast" else _counts(result.verify)
        steps = self.decode_graph if counts is None else self.verifier
        if counts is not None:
            self.verifier.current.fill_(result.tokens[-1])
        try:
            # Verified mode feeds the last token too: that is the finish's feed. Fast mode
            # skips it where the count ends the reply (its decoder's cache is dropped).
            self._held_steps(steps, n - len(result.tokens), result, stops, n, on_block,
                             constraint, counts, feed_last=counts is not None)
        finally:
            if counts is not None:
                result.verify = _report(len(result.tokens), counts)

    def _held_steps(self, steps, count: int, result, stops, n, on_block, constraint,
                    counts=None, feed_last: bool = False) -> bool:
        """Up to ``count`` held steps of ``steps`` (the decoder, or the verifier: exact), each
        token emitted as it comes (unimax.held): load the grammar's mask for the next token,
        queue the choice, queue the forward that feeds the chosen token, and only then read
        the token and feed it to the grammar, so the host's turn runs while the GPU runs the
        next forward. The first forward feeds the reply's last token. After the last step
        the forward is queued only where ``feed_last``; else the last token is left unfed
        (after a stop id with the forward queued ahead, the stop is fed). False when the
        reply ended (``_emit``'s: a stop id, its length, a cancel)."""
        mask = self.decode_graph.token_mask
        steps.held_forward()
        for i in range(count):
            more = i + 1 < count
            mask.load(constraint)
            steps.held_choice()
            if self.held_ahead and (more or feed_last):
                steps.held_forward()
            token = steps.held_token.receive()
            mask.penalties.add([token])  # (queued before the next choice)
            if counts is not None:
                counts.verifier_blocks += 1
            if not self._emit(result, [token], stops, n, on_block, constraint):
                return False
            if not self.held_ahead and more:
                steps.held_forward()
        return True

    def _finish(self, result: Generation, mode: str, state_before: int,
                held: bool = False, last_unfed: bool = False) -> None:
        """Leave the exact cache at input + every emitted token (the last one fed too).

        Fast mode never touched the exact cache after the prefill: one exact chunked forward
        over the reply brings it there (the same state a fresh prefill of prompt + reply
        gives). Verified mode kept it exact block by block: restore the last block's snapshot
        and feed that block's emitted tokens. A reply ``held`` to a grammar in verified mode
        (its held steps, masked blocks and exact runs) left the exact cache fed through its
        last token or the one before, never past it: feed what it has not, if anything.
        ``last_unfed``: all but the last token (a held reply's steps after its thinking block
        feed it)."""
        if not result.tokens:
            return
        prompt_state = state_before + result.prefill_tokens
        if mode == "fast":
            # The exact cache still holds the prompt state (or, where a grammar's held steps
            # followed a thinking block, the reply up to them): feed the rest.
            fed = result.tokens[self.exact_cache.seen_tokens - prompt_state:]
        else:
            # Roll back to the start of the last verified block (or the prompt state when no
            # block ran) and feed what was emitted since.
            if not held and result.verify is not None and result.verify.verifier_blocks > 0:
                self.verifier.restore_snapshot()
            fed = result.tokens[self.exact_cache.seen_tokens - prompt_state:]
        if last_unfed:
            fed = fed[:-1]
        if not fed:
            return
        ids = torch.tensor([fed], dtype=torch.long, device=self.device)
        with self.exact_cache.attending(self.exact_cache.seen_tokens + len(fed)):
            self.exact_model.forward_unchecked(ids, self.exact_cache, logits_to_keep=1)
        self.exact_cache.seen_tokens += len(fed)


def _report(generated: int, counts: VerifyCounts) -> VerifyReport:
    return VerifyReport(generated, counts.drafted, counts.accepted, counts.rejected_blocks,
                        counts.verifier_blocks)


def _counts(report: VerifyReport | None) -> VerifyCounts:
    """Counts that go on from ``report`` (a thinking block's verified blocks), or new ones."""
    if report is None:
        return VerifyCounts()
    return VerifyCounts(report.drafted_tokens, report.accepted_draft_tokens,
                        report.rejected_blocks, report.verifier_blocks)


def _count(n) -> int:
    n = int(n)
    if n < 0:
        raise ValueError(f"number of new tokens must be >= 0, got {n}")
    return n


def _block_arg(draft_block: int | None, default: int) -> int | None:
    """A fixed draft length, or None: the draft-length policy chooses per block."""
    if draft_block is None:
        return None
    if not isinstance(draft_block, int) or not 1 <= draft_block <= default:
        raise ValueError(f"draft_block must be an integer in 1..{default} (the decoder's "
                         f"block size), got {draft_block!r}")
    return draft_block
