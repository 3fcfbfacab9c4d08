"""The graph decoder: its own cache and static buffers, k-step blocks captured as CUDA graphs.

A block of k one-token steps runs as one graph replay: each step feeds the previous token, picks
the next on the GPU (argmax, or sampling from a uniform drawn before the block) and writes it to
a static buffer, so there is no host sync inside a block. On the CPU, and wherever graphs are off,
the very same block function runs eagerly: same ops, same results.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from . import kernels
from .cache import RecurrentCache, copy_cache_
from .held import TokenToHost, choose, logits_buffer
from .ops import choices, pdl
from .ops.choices import ChoiceTable
from .ops.gated_delta import fla_ops
from .ops.timing import gc_paused, median_replay_ms
from .sampling import SamplingParams, sample_from_logits, sample_with_probs


class GraphRunner:
    """Runs a block function eagerly, or captures it once per key and replays the graph.

    Capture needs warm-up runs (Triton autotuning, allocator growth), and those really execute:
    every cache the function writes is saved before and restored after, so capturing leaves no
    trace in the state. All graphs of one runner share one memory pool. With ``timed``, each new
    graph is timed (``replay_ms``, the median of a few replays, before the restore): verified
    mode chooses its draft lengths from the decoder's and the verifier's (unimax.draft_length).
    """

    def __init__(self, device: torch.device, use_graphs: bool, timed: bool = False):
        self.device = device
        self.use_graphs = use_graphs
        self.timed = timed
        self.graphs: dict[object, torch.cuda.CUDAGraph] = {}
        self.replay_ms: dict[object, float] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def run(self, key, fn: Callable[[], None], writes: list[RecurrentCache],
            buffers: list[torch.Tensor] = ()) -> None:
        if not self.use_graphs:
            fn()
            return
        self.prepare(key, fn, writes, buffers)
        self.graphs[key].replay()

    def prepare(self, key, fn: Callable[[], None], writes: list[RecurrentCache],
                buffers: list[torch.Tensor] = ()) -> None:
        """Capture now (if graphs are on and this key has none yet), leaving no trace."""
        if self.use_graphs and key not in self.graphs:
            self.graphs[key], replay_ms = self.capture(fn, writes, buffers)
            if replay_ms is not None:
                self.replay_ms[key] = replay_ms

    def forget(self, key) -> None:
        """Drop ``key``'s graph (the next run captures it again)."""
        self.graphs.pop(key, None)
        self.replay_ms.pop(key, None)

    def capture(self, fn, writes, buffers) -> tuple[torch.cuda.CUDAGraph, float | None]:
        start = time.perf_counter()
        with trial_run(writes, buffers):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                warm_up(fn, writes)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            warmed = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            # "thread_local": only this thread's unsafe calls (a sync, a cudaMalloc) spoil the
            # capture, not another thread's (the app's server threads, a compiler's workers
            # loading kernels). Under the default "global" one capture of the GPU suite failed
            # once at fla's launch, "a previous error during capture", and passed when re-run
            # (bench/RESULTS.md, 2026-12-01; whether another thread did it is not known).
            # Inductor captures its own graphs this way too. The likelier cause of that failure
            # is a garbage collection mid-capture destroying a dropped engine's graphs, which
            # failed a kernel choice's timing the same way (ops.timing.gc_paused): paused.
            with gc_paused(), torch.cuda.graph(graph, pool=self.pool,
                                               capture_error_mode="thread_local"):
                fn()
            replay_ms = None
            if self.timed:
                replay_ms = median_replay_ms(graph, before=lambda: from_position_0(writes))
        CAPTURE_SPENT["graphs"] += 1
        CAPTURE_SPENT["warm_up_s"] += warmed - start
        CAPTURE_SPENT["capture_s"] += time.perf_counter() - warmed
        return graph, replay_ms


# what graph captures have cost this process (a share of the app's warm-up; the service bench
# prints it per mode): graphs, their warm-up runs (first calls: compiles, kernel choices), and
# the captures themselves (with a timed runner's replays)
CAPTURE_SPENT = {"graphs": 0, "warm_up_s": 0.0, "capture_s": 0.0}

WARM_UPS = 2  # Triton's autotuning and the allocator's growth before a graph is recorded


def from_position_0(writes: list[RecurrentCache]) -> None:
    for cache in writes:
        cache.position.zero_()


def warm_up(fn: Callable[[], None], writes: list[RecurrentCache], runs: int = WARM_UPS) -> None:
    """Capture's warm-up runs of a graph body, each from position 0. A run advances the
    device-side position, and a body whose padded forward fills the KV buffers (a short-prefill
    bucket as long as the context) would, from the position the run before left, write one KV
    entry past them: a device-side assert that took the H200 run's whole CUDA context down."""
    for _ in range(runs):
        from_position_0(writes)
        fn()


@contextlib.contextmanager
def trial_run(writes: list[RecurrentCache], buffers: list[torch.Tensor] = ()):
    """For the body of a with-block that really runs graph bodies (capture's warm-ups): every
    cache they write and every buffer are saved before and restored after, and the caches'
    positions are 0 meanwhile. Graphs read the position on the device, so they are the same
    captured from 0; from the real one, near the context's end, a warm-up would write KV past
    the buffers (a device-side assert)."""
    saved = [cache.empty_like() for cache in writes]
    for copy, cache in zip(saved, writes, strict=True):
        copy_cache_(copy, cache)
    saved_buffers = [b.clone() for b in buffers]
    from_position_0(writes)
    for cache in writes:
        cache.seen_tokens = 0
    try:
        yield
    finally:
        for copy, cache in zip(saved, writes, strict=True):
            copy_cache_(cache, copy)
        for saved_buffer, buffer in zip(saved_buffers, buffers, strict=True):
            buffer.copy_(saved_buffer)


def pdl_candidate(model) -> bool | str:
    """What PDL "auto" times against plain launches in a decoder of ``model`` (a view):
    "fp8" where its fused blocks hold FP8 GEMVs (a draft: those only), True where they hold
    BF16 ones only (the BF16 fast step), False where no block is fused (nothing to launch
    early: ops.fused_gemv's launches alone take PDL)."""
    from .fp8 import FP8Linear
    from .fused_draft import fusable

    kinds = {isinstance(module, FP8Linear) for block in getattr(model, "layers", ())
             if getattr(block, "fused", False) for module in block.modules() if fusable(module)}
    return "fp8" if True in kinds else bool(kinds)


def pdl_timable(candidate: bool | str, runner: GraphRunner) -> bool:
    """Whether PDL "auto" has a choice to time: a candidate setting, graphs (a timed runner)
    and a GPU with programmatic dependent launch; the kernel configuration's pdl left "auto"."""
    return bool(candidate) and runner.use_graphs and runner.timed and \
        kernels.active().pdl == "auto" and pdl.pdl_possible(runner.device)


# PDL "auto"'s choices by (owner, pdl_signature), remembered as the kernel choices are
PDL_CHOICES = ChoiceTable("pdl")


def pdl_signature(model, block_size: int) -> tuple:
    """What a PDL choice depends on beyond the card: the view (exact or quantized) and its
    shape, and the block's length."""
    cfg = model.config
    return (getattr(model, "quantized", "bf16"), cfg.num_hidden_layers, cfg.hidden_size,
            cfg.intermediate_size, cfg.vocab_size, cfg.num_v_heads, cfg.head_v_dim,
            tuple(cfg.layer_types or ()), block_size)


def timed_pdl_choice(runner: GraphRunner, key, candidate: bool | str,
                     capture: Callable[[bool | str, str], None],
                     remember_as: tuple | None = None) -> tuple[bool | str, str, dict]:
    """PDL "auto"'s choice for one owner of graphs (a decoder, the verifier): ``capture(s,
    t)`` captures ``key`` into ``runner`` with its blocks in setting s, signalled at trigger t;
    captured plain and then in ``candidate`` at each of ``pdl.auto_triggers()``, the
    fastest graph stays under ``key`` with its time (a tie, or a time that could not be
    taken, keeps the earlier: plain launches first). Returns (the setting kept, its trigger,
    each timed setting's ms by ``pdl.pdl_label``). ``remember_as``: the choice's key in
    the remembered choices (ops.choices): one known there is captured alone, untimed; one timed
    while choices are deferred (the app) is written to the disk cache for the next start."""
    settings = [(False, "start")] + [(candidate, t) for t in pdl.auto_triggers()]
    if remember_as is not None:
        known = choices.remembered(PDL_CHOICES, remember_as, settings)
        if known is not None:
            runner.forget(key)
            capture(*known)
            return *known, {}
    found = {}
    for setting, trigger in settings:
        runner.forget(key)
        capture(setting, trigger)
        found[setting, trigger] = (runner.graphs[key], runner.replay_ms.get(key))
    times = {choice: ms for choice, (_, ms) in found.items()}
    kept = (False, "start") if None in times.values() else min(times, key=times.get)
    runner.forget(key)
    runner.graphs[key] = found[kept][0]
    if times[kept] is not None:
        runner.replay_ms[key] = times[kept]
    if remember_as is not None and choices.deferred():
        choices.remember([(PDL_CHOICES, remember_as, kept)])
    return *kept, {pdl.pdl_label(*choice): ms for choice, ms in times.items()}


class MaxTurboGraphDecoder:
    """Decodes with ``model`` (the exact model or a quantized view) from its own cache.

    ``static_token`` holds the next token to feed; ``decode_tokens(first, n)`` feeds ``first``
    and then each token it produces, and returns the n produced tokens (1, n). After it the
    cache has absorbed ``first`` and the first n - 1 produced tokens; the last is pending in
    ``static_token``. Batch size 1.
    """

    def __init__(self, model, block_size: int = 8, use_graphs: bool | None = None,
                 compile: bool = False):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not hasattr(model, "make_recurrent_cache"):
            raise TypeError(f"{type(model).__name__} has no recurrent cache "
                            "(make_recurrent_cache); UNI MAX decodes recurrent models only")
        self.model = model.eval()
        self.device = model.device
        self.block_size = block_size
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model; use use_graphs=False on the CPU")
        self.cache = model.make_recurrent_cache(1)
        long = dict(dtype=torch.long, device=self.device)
        self.static_token = torch.zeros(1, 1, **long)
        self.out_tokens = torch.zeros(1, block_size, **long)
        self.temperature = torch.ones(1, device=self.device)
        self.top_k = torch.zeros(1, **long)
        self.top_p = torch.ones(1, device=self.device)
        self.min_p = torch.zeros(1, device=self.device)
        self.uniforms = torch.zeros(block_size, device=self.device)
        # Verified sampling: the distribution each draft token was drawn from (speculative.py)
        self.draft_probs = torch.zeros(block_size, model.config.vocab_size, device=self.device)
        self.sampling = SamplingParams()
        self.generator = torch.Generator(device=self.device)
        # A reply held to a grammar (unimax.held): the grammar's mask over a held step's
        # choice, set by the engine (one for its decoder and verifier: unimax.token_mask); the
        # held forward's logits (allocated at its first run) and the chosen token's way out
        self.token_mask = None
        self.held_logits: torch.Tensor | None = None
        self.held_token = TokenToHost(self.device)
        # a sampled held draft's masked distribution (``held_choice(record=True)``), kept as
        # the block's draft_probs row by ``keep_draft``
        self.held_probs = torch.zeros(1, model.config.vocab_size, device=self.device)
        self.runner = GraphRunner(self.device, use_graphs, timed=True)
        # Programmatic dependent launch of the fused GEMVs in this decoder's blocks, where the
        # kernel configuration's pdl is "auto": chosen by timing (choose_pdl), None until then; the
        # choice's replay times by setting ({} where nothing was timed)
        self.pdl: bool | str | None = None
        self.pdl_trigger = "start"  # (where its launches signal the next: the choice's too)
        self.pdl_ms: dict[str, float] = {}
        # torch.compile (inductor) fuses the step's many small elementwise kernels; the graphs
        # are still captured here, around the compiled step. fla is looked up first, so that
        # the compiled step reads the answer and never imports (ops.gated_delta.fla_ops).
        if compile and self.device.type == "cuda":
            fla_ops()
        self._step = torch.compile(self._step_eager, dynamic=False) if compile else \
            self._step_eager

    @property
    def use_graphs(self) -> bool:
        return self.runner.use_graphs

    def reset(self) -> None:
        self.cache.reset()
        self.static_token.zero_()

    def set_sampling(self, params: SamplingParams | None) -> None:
        """Greedy (None or temperature 0) or sampled; a seed restarts the random stream."""
        params = params or SamplingParams()
        self.sampling = params
        if not params.is_greedy:
            self.temperature.fill_(params.temperature)
            self.top_k.fill_(params.top_k)
            self.top_p.fill_(params.top_p)
            self.min_p.fill_(params.min_p)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    # --- one block -----------------------------------------------------------------------

    def _step_eager(self, token: torch.Tensor) -> torch.Tensor:
        return self.model.forward_unchecked(token, self.cache, logits_to_keep=1)[:, -1]

    def _block(self, n: int, sampled: bool, record: bool = False) -> None:
        with pdl.auto_pdl(self.pdl or False, self.pdl_trigger):
            self._block_steps(n, sampled, record)

    def _block_steps(self, n: int, sampled: bool, record: bool) -> None:
        token = self.static_token
        for i in range(n):
            logits = self._step(token)
            if record:  # a draft of verified sampling: keep the distribution it drew from
                token, probs = sample_with_probs(logits, self.temperature, self.top_k,
                                                 self.top_p, self.uniforms[i:i + 1], self.min_p)
                self.draft_probs[i:i + 1].copy_(probs)
            elif sampled:
                token = sample_from_logits(logits, self.temperature, self.top_k, self.top_p,
                                           self.uniforms[i:i + 1], self.min_p)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            self.out_tokens[:, i:i + 1].copy_(token)
        self.static_token.copy_(token)

    def _buffers(self, record: bool) -> list[torch.Tensor]:
        """What a block writes besides the cache (saved around a capture)."""
        written = [self.static_token, self.out_tokens]
        return written + [self.draft_probs] if record else written

    @staticmethod
    def _key(n: int, sampled: bool, record: bool):
        return (n, "record") if record else (n, sampled)

    @torch.inference_mode()
    def choose_pdl(self) -> None:
        """Where the kernel configuration's pdl is "auto", graphs are on and the GPU has
        programmatic dependent launch (compute capability 9+; not an L4): capture the greedy block
        of block_size steps with plain launches and with PDL on this model's fused GEMVs
        (``pdl_candidate``), signalled at each program's start and at its end, keep the fastest
        graph and use its setting (``pdl``, ``pdl_trigger``) for every block captured after
        (``timed_pdl_choice``). Once per decoder (``pdl`` None until then); elsewhere plain
        launches.

        Why timed: PDL's sign depends on the shape and the run. On the H200 it made the 0.8B
        draft step 5-7% faster and the 4B one 4% slower, where an earlier
        run had the 4B draft 3.8% faster (bench/RESULTS.md)."""
        if self.pdl is not None:
            return
        self.pdl = False
        candidate = pdl_candidate(self.model)
        if not pdl_timable(candidate, self.runner):
            return
        key = self._key(self.block_size, False, False)

        def capture(setting, trigger):
            self.pdl, self.pdl_trigger = setting, trigger
            self.runner.prepare(key, lambda: self._block(self.block_size, False),
                                writes=[self.cache], buffers=self._buffers(False))

        self.pdl, self.pdl_trigger, self.pdl_ms = timed_pdl_choice(
            self.runner, key, candidate, capture,
            ("decoder",) + pdl_signature(self.model, self.block_size))

    @torch.inference_mode()
    def capture_blocks(self, sampled: bool = False, record: bool = False) -> None:
        """Capture the block graphs of every size 1..block_size now (start-up), not at first
        use in the middle of a reply. ``record``: the sampled blocks of verified sampling."""
        self.choose_pdl()
        for n in range(1, self.block_size + 1):
            self.runner.prepare(self._key(n, sampled, record),
                                lambda n=n: self._block(n, sampled or record, record),
                                writes=[self.cache], buffers=self._buffers(record))

    @torch.inference_mode()
    def run_block(self, n: int, record: bool = False) -> torch.Tensor:
        """Feed ``static_token`` and n - 1 produced tokens; returns a view of the n produced
        tokens (valid until the next block). No host sync. ``record`` (sampling only): also
        write each token's warped distribution to ``draft_probs``."""
        if not 1 <= n <= self.block_size:
            raise ValueError(f"a block has 1..{self.block_size} steps, got {n}")
        sampled = not self.sampling.is_greedy
        record = record and sampled
        if sampled:
            self.uniforms[:n].uniform_(generator=self.generator)
        self.choose_pdl()  # (before this decoder's first graph; once, a no-op without graphs)
        seen = self.cache.seen_tokens
        self.runner.run(self._key(n, sampled, record),
                        lambda: self._block(n, sampled, record),
                        writes=[self.cache], buffers=self._buffers(record))
        self.cache.seen_tokens = seen + n  # Python-side bookkeeping is not part of a graph
        return self.out_tokens[:, :n]

    # --- a reply held to a grammar (unimax.held): forward and choice, two graphs ------------

    def _held_forward(self) -> None:
        with pdl.auto_pdl(self.pdl or False, self.pdl_trigger):
            logits = self._step(self.static_token)
        self.held_logits = logits_buffer(logits, self.held_logits)
        self.held_logits.copy_(logits)

    def _held_choice(self, sampled: bool, record: bool = False) -> None:
        self.static_token.copy_(choose(self.held_logits, self, self.uniforms[:1], sampled,
                                       self.held_probs if record else None))

    def _held_key(self, sampled: bool, record: bool):
        """A held choice's graph key and the buffers it writes."""
        if record:
            return ("held", "choice", "record"), self._buffers(False) + [self.held_probs]
        return ("held", "choice", sampled), self._buffers(False)

    @torch.inference_mode()
    def capture_held(self, sampled: bool = False, record: bool = False) -> None:
        """Capture the held step's graphs now (start-up), not at a held reply's first token:
        the forward, then the greedy choice (``sampled``: the sampled one too; ``record``: the
        sampled one that records its distribution, verified sampling's drafts)."""
        self.choose_pdl()
        self.runner.prepare(("held", "forward"), self._held_forward, writes=[self.cache])
        kinds = [(False, False)] + [(True, False)] * sampled + [(True, True)] * record
        for s, r in kinds:
            key, buffers = self._held_key(s, r)
            self.runner.prepare(key, lambda s=s, r=r: self._held_choice(s, r), writes=[],
                                buffers=buffers)

    @torch.inference_mode()
    def held_forward(self) -> None:
        """Feed ``static_token``; its logits wait in ``held_logits`` for ``held_choice``. No
        host sync (its graph captured by capture_held, else at first use)."""
        self.choose_pdl()  # (the setting the blocks took: one choice per decoder)
        self.runner.run(("held", "forward"), self._held_forward, writes=[self.cache])
        self.cache.seen_tokens += 1

    @torch.inference_mode()
    def held_choice(self, record: bool = False) -> None:
        """The next token from the last held forward's logits, kept to ``token_mask`` (loaded
        by the caller), into ``static_token``, and its copy to the host queued
        (``held_token.receive()`` reads it). No host sync. ``record`` (sampling only): the
        masked distribution drawn from into ``held_probs``."""
        if self.token_mask is None or self.held_logits is None:
            raise ValueError("a held choice needs token_mask set and a held_forward before it")
        sampled = not self.sampling.is_greedy
        record = record and sampled
        if sampled:
            self.uniforms[:1].uniform_(generator=self.generator)
        key, buffers = self._held_key(sampled, record)
        self.runner.run(key, lambda: self._held_choice(sampled, record), writes=[],
                        buffers=buffers)
        self.held_token.send(self.static_token)

    def keep_draft(self, i: int, record: bool = False) -> None:
        """The last held choice as the block's draft i (``out_tokens``, where the verifier
        reads a block's drafts): a draft held to a grammar; ``record``: its distribution
        (``held_probs``) as ``draft_probs`` row i too. No host sync."""
        self.out_tokens[:, i:i + 1].copy_(self.static_token)
        if record:
            self.draft_probs[i:i + 1].copy_(self.held_probs)

    @torch.inference_mode()
    def decode_tokens(self, first_token: torch.Tensor, n: int) -> torch.Tensor:
        n = int(n)
        if n < 0:
            raise ValueError(f"number of tokens to decode must be >= 0, got {n}")
        if first_token.shape != (1, 1):
            raise ValueError(f"the graph decoder runs batch size 1: first_token must have shape "
                             f"(1, 1), got {tuple(first_token.shape)}")
        self.static_token.copy_(first_token)
        pieces = []
        while n > 0:
            k = min(self.block_size, n)
            pieces.append(self.run_block(k).clone())
            n -= k
        if not pieces:
            return torch.empty(1, 0, dtype=torch.long, device=self.device)
        return torch.cat(pieces, dim=1)

    def decode_forwards(self, first_token: torch.Tensor, n: int) -> torch.Tensor:
        """The seed's name for n graph forwards after ``first_token``: the n tokens they chose."""
        return self.decode_tokens(first_token, n)
