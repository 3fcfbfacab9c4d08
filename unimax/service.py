"""The engine service: one long-lived thread owns the model and the GPU and serves chat requests
from a queue, streaming events back. Knows nothing about Gradio.

Each request carries a cancel flag the thread checks after every decoded block. A failing request
ends with an error event; the thread goes on with the next one, and since every request starts
from a kept state (StateStore), no failure can corrupt another conversation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from . import logprobs, memory
from .build import build_engine
from .chat import check_messages, check_text, encode_chat, encode_text, history_end, stop_ids
from .checkpoint import load_model, load_tokenizer
from .detokenize import IncrementalDetokenizer
from .errors import RequestError
from .exact import ExactSide
from .logprobs import EntryText, LogprobsRequest, score_chunk
from .modes import APP_MODES, MODES
from .ops import choices
from .presets import Preset, PresetError
from .reasoning import ThinkingEnd, opens_thinking
from .settings import GenerationSettings
from .states import StateStore
from .structured import Constraint, Grammars, ResponseFormat, ToolCallFormat

log = logging.getLogger("unimax.service")
# A token is rarely longer than this many characters: longer conversations cannot fit the
# context, and are refused before the tokenizer sees them.
MAX_CHARS_PER_TOKEN = 16


@dataclass
class ServiceEvent:
    kind: str  # queued, started, prefill (progress through a long prompt), delta, stats, done,
    # error
    text: str = ""
    data: dict = field(default_factory=dict)


class RequestHandle:
    """What the caller holds: iterate for events; ``cancel()`` stops it within one block."""

    def __init__(self, request_id: int, conversation_id: str, messages: list[dict], mode: str,
                 settings: GenerationSettings):
        self.id = request_id
        self.conversation_id = conversation_id
        self.messages = messages
        self.mode = mode
        self.settings = settings
        self.cancelled = threading.Event()
        # why it was cancelled: "cancelled" (the user), "stop" (the caller ended the reply at a
        # stop string or a finished tool call: metrics count it as stopped, not cancelled)
        self.cancel_reason: str | None = None
        self.finished = threading.Event()
        self.queue: queue.Queue[ServiceEvent] = queue.Queue()
        self._listener: Callable[[ServiceEvent], None] | None = None
        self._listener_lock = threading.Lock()
        self.submitted_at = time.perf_counter()
        self.prompt: list[int] = []  # token ids, set by EngineService.submit
        self.text: str | None = None  # a raw prompt to continue (no chat template), not a chat
        self.tokens: list[int] | None = None  # a prompt given as token ids (the API's)
        self.logprobs: LogprobsRequest | None = None  # served by the exact model (logprobs.py)
        self.outcome: tuple[str, dict] | None = None  # the final event's kind and data
        self.internal = False  # the warm-up's own reply: no user's request, not in metrics
        self.thinking_open = False  # the chat prompt leaves a <think> block open (reasoning.py)
        self.tools: list[dict] | None = None  # functions offered to the chat template
        # the reply held to a grammar (structured.py): the compiled grammar, set by prepare()
        self.response_format: ResponseFormat | ToolCallFormat | None = None
        self.grammar = None
        # where later turns stop matching the prompt (chat.history_end): the state kept is
        # the one there, not after the reply
        self.keep_at: int | None = None
        # a race (EngineService.race): called after each block, it hands the engine thread's
        # turn to the other reply and returns when this one's turn comes back; ``waited``:
        # the seconds spent so, left out of this reply's decode rates
        self.between_blocks: Callable[[], None] | None = None
        self.waited = 0.0

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
        self.cancelled.set()

    def emit(self, kind: str, text: str = "", **data) -> None:
        if kind in ("done", "error"):
            self.outcome = (kind, {"text": text, **data})
        event = ServiceEvent(kind, text, data)
        with self._listener_lock:
            if self._listener is not None:
                self._listener(event)
            else:
                self.queue.put(event)
        if kind in ("done", "error"):
            self.finished.set()

    def subscribe(self, listener: Callable[[ServiceEvent], None]) -> None:
        """Hand every event to ``listener`` instead of the queue: those queued so far at once,
        in order, then each as it is emitted (on the emitting thread, so it must only hand the
        event on). An event loop waits for events this way without a thread per request
        (ui/openai_api.py); ``events()`` is for threads."""
        with self._listener_lock:
            while True:
                try:
                    listener(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._listener = listener

    def events(self, timeout: float | None = None) -> Iterator[ServiceEvent]:
        """Events until done or error. ``timeout`` bounds the wait for each event."""
        while True:
            event = self.queue.get(timeout=timeout)
            yield event
            if event.kind in ("done", "error"):
                return


@dataclass
class _Task:
    """Work other than a reply that must run on the engine thread (graph capture)."""

    fn: object
    done: threading.Event


@dataclass
class _Race:
    """Replies served side by side, a block each in turn (EngineService.race)."""

    handles: list[RequestHandle]


class _Baton:
    """Whose turn it is among racing replies: one runs on the engine's GPU at a time, and
    each hands the turn on after a block."""

    def __init__(self, count: int):
        self.cond = threading.Condition()
        self.order = list(range(count))  # those still running, in turn order
        self.turn = 0

    def wait(self, racer: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == racer)

    def pass_on(self, racer: int, leave: bool = False) -> None:
        with self.cond:
            at = self.order.index(racer)
            if leave:
                self.order.remove(racer)
            if self.order:
                self.turn = self.order[(at if leave else at + 1) % len(self.order)]
            self.cond.notify_all()


class EngineService:
    def __init__(self, preset: Preset, model=None, tokenizer=None):
        self.preset = preset
        device = None if preset.device == "auto" else preset.device
        self.model = model if model is not None else load_model(
            preset.model, device=device, dtype=preset.dtype, max_context=preset.max_context)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(preset.model)
        self.device = self.model.device
        if preset.draft == "mtp" and getattr(self.model, "mtp", None) is None:
            raise PresetError(f"the preset's draft is 'mtp' but {preset.model} has no MTP "
                              "module (Qwen3.5's mtp.* weights): use draft: full")
        # what the preset's parts take on the GPU (unimax.memory), refused here if it cannot fit
        self.memory_plan = memory.plan(self.model, preset) if self.device.type == "cuda" \
            else []
        if self.memory_plan:
            with torch.cuda.device(self.device):
                memory.check(self.memory_plan, memory.capacity())
        self.engines: dict[str, object] = {}
        self.exact: ExactSide | None = None  # (exact_side)
        self.store = StateStore(preset.state_memory_mib * 2**20,
                                preset.host_state_memory_mib * 2**20)
        self.stop_ids = stop_ids(self.tokenizer, self.model.config.eos_token_id,
                                 self.model.config.vocab_size)
        self.tokenizer_lock = threading.Lock()  # requests tokenize on their callers' threads
        # (and compile their response formats there: Grammars bounds their size and time)
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.stop_ids)
        self.requests: queue.Queue[RequestHandle | None] = queue.Queue()
        self.pending: list[RequestHandle] = []
        self.pending_lock = threading.Lock()
        self.ids = itertools.count(1)
        self.stats_lock = threading.Lock()
        self.latest_stats: dict = {"mode": preset.mode}
        # a background warm-up's progress (warm_up_in_background), under stats_lock
        self.warm_up_state: dict = {"running": None, "ready": [], "pending": [], "error": None}
        self.thread = threading.Thread(target=self._loop, name="unimax-engine", daemon=True)
        self.busy = threading.Event()
        self.racers: concurrent.futures.ThreadPoolExecutor | None = None  # (EngineService.race)
        # Called on the engine thread with each request it ran, once it ended (metrics); not
        # with the warm-up's own replies.
        self.listeners: list[Callable[[RequestHandle], None]] = []

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineService:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self.pending_lock:
            for handle in self.pending:
                handle.cancel()
        self.requests.put(None)
        self.thread.join(timeout)
        if self.racers is not None:
            self.racers.shutdown(wait=False)

    def warm_up_in_background(self, first: str | None = None,
                              on_done: Callable[[float, str | None], None] | None = None,
                              on_ready: Callable[[str, float], None] | None = None
                              ) -> threading.Thread:
        """``warm_up`` of every mode on a thread of its own, ``first`` (the preset's mode by
        default) first, so that the page and the API serve while it runs and each mode serves
        at full speed as soon as it is ready: on a GPU each mode compiles its steps and
        captures its graphs. A reply sent meanwhile waits for the engine thread behind the
        warm-up work queued before it, and says so (its "queued" event carries
        ``warming_up``, the mode being warmed). ``warm_up_state`` tells how far it is (the
        /health route shows it); ``on_ready(mode, seconds)`` as each mode is ready,
        ``on_done(seconds, error or None)`` once all are. Then the kernel choices the warm-up
        left to their defaults (ops.choices, deferred by the app) are timed between replies, one
        at a time, and remembered on disk for the next start (``tuning`` counts those left).
        A mode that fails to warm up is logged and skipped: its replies capture on first use or
        report their own error."""
        first = first or self.preset.mode
        order = (first,) + tuple(mode for mode in MODES if mode != first)
        with self.stats_lock:
            self.warm_up_state = {"running": None, "ready": [], "pending": list(order),
                                  "error": None, "seconds": {}, "tuning": 0}

        def run() -> None:
            start, error = time.perf_counter(), None
            for mode in order:
                with self.stats_lock:
                    self.warm_up_state["pending"].remove(mode)
                    self.warm_up_state["running"] = mode
                failed = None
                try:
                    self.warm_up((mode,))
                except Exception as err:
                    log.exception("warm-up of mode %s failed", mode)
                    failed = error = f"{mode}: {err}"
                seconds = time.perf_counter() - start
                with self.stats_lock:
                    self.warm_up_state["running"] = None
                    if failed is None:
                        self.warm_up_state["ready"].append(mode)
                        self.warm_up_state["seconds"][mode] = round(seconds, 2)
                    self.warm_up_state["error"] = error
                if failed is None and on_ready is not None:
                    on_ready(mode, seconds)
            if on_done is not None:
                on_done(time.perf_counter() - start, error)
            self.tune_deferred()

        thread = threading.Thread(target=run, name="unimax-warm-up", daemon=True)
        thread.start()
        return thread

    def tune_deferred(self) -> int:
        """Time the kernel choices left to their defaults (ops.choices.PENDING), one per engine
        task, so that a reply sent meanwhile waits for one choice at most; the winners go to
        the disk cache for the next start. How many were timed."""
        timed = 0
        while choices.PENDING and self.thread.is_alive():
            with self.stats_lock:
                self.warm_up_state["tuning"] = len(choices.PENDING)
            done = threading.Event()
            self.requests.put(_Task(lambda: choices.tune_pending(1), done))
            while not done.wait(1.0):
                if not self.thread.is_alive():  # (stopped: the task will never run)
                    return timed
            timed += 1
        with self.stats_lock:
            self.warm_up_state["tuning"] = 0
        return timed

    def memory_said(self, after_warm_up: bool = False) -> str:
        """The memory plan against the card (unimax.memory), and after the warm-up what it
        measured; empty off CUDA."""
        if not self.memory_plan:
            return ""
        with torch.cuda.device(self.device):
            if after_warm_up:
                kept = int(self.store.usage()["gpu_mib"] * 2**20)
                return memory.measured(self.memory_plan, kept)
            return memory.describe(self.memory_plan, memory.capacity())

    def warming_mode(self) -> str | None:
        """The mode a background warm-up is on now, or None."""
        with self.stats_lock:
            return self.warm_up_state["running"]

    def warm_up_snapshot(self) -> dict:
        """A copy of ``warm_up_state`` (running, ready, pending, error, seconds: each ready
        mode's time from the warm-up's start, tuning: kernel choices left to time)."""
        with self.stats_lock:
            return {key: type(value)(value) if isinstance(value, list | dict) else value
                    for key, value in self.warm_up_state.items()}

    def warm_up(self, modes: tuple[str, ...] = MODES) -> None:
        """Build every mode's engine and capture its graphs now, not on the first message:
        one short reply per mode (kernels autotuned, block graphs captured), then every other
        graph a reply can meet, the sampling ones included (a reply with a temperature would
        otherwise capture them in its first blocks)."""
        for mode in modes:
            handle = self.submit(f"warm-up-{mode}", [{"role": "user", "content": "Hi"}], mode,
                                 GenerationSettings(max_new_tokens=2 * self.preset.block_size),
                                 internal=True)
            for event in handle.events():
                if event.kind == "error":
                    raise RuntimeError(f"warm-up of mode {mode} failed: {event.text}")
            self.store.forget(f"warm-up-{mode}")
            done = threading.Event()
            self.requests.put(_Task(lambda mode=mode: self._engine(mode).capture_graphs(
                verified=APP_MODES[mode].verified, sampled=True), done))
            done.wait()

    # --- requests ------------------------------------------------------------------------

    def submit(self, conversation_id: str, messages: list[dict], mode: str | None = None,
               settings: GenerationSettings | None = None, *,
               text: str | None = None, tokens: list[int] | None = None,
               logprobs: LogprobsRequest | None = None,
               tools: list[dict] | None = None,
               response_format: ResponseFormat | ToolCallFormat | None = None,
               internal: bool = False) -> RequestHandle:
        """Queue a reply to ``messages`` (or to a raw ``text`` or ``tokens`` prompt). The
        request is checked and tokenized here, on the caller's thread, so a bad or huge
        message never holds up the engine thread: a request the user can fix ends at once with
        an error event. With ``logprobs`` the exact model serves it, whatever the mode, and
        each "delta" event carries its tokens' entries (see ``_serve_exact``). ``tools``:
        OpenAI's function list, rendered by the chat template (tool_calls.py reads the calls).
        ``response_format``: the reply held to JSON, a JSON schema or a tool call in the model's
        call format (structured.py), after the thinking block when the prompt opens one; the
        mode's engine serves it one token at a time, each masked before it is chosen
        (UniMaxEngine.generate's ``constraint``, unimax.held). The "done" event carries the
        reply's text and its token ids (no stop id)."""
        handle = self._handle(conversation_id, messages, mode, settings)
        handle.text, handle.tokens, handle.logprobs = text, tokens, logprobs
        handle.tools, handle.response_format = tools, response_format
        handle.internal = internal
        if self._queued(handle):
            self.requests.put(handle)
        return handle

    def race(self, requests: list[tuple[str, list[dict], str, GenerationSettings]]
             ) -> list[RequestHandle]:
        """Queue replies that run side by side: (conversation id, messages, mode, settings)
        each, as ``submit`` takes them. The engine thread serves them a block each in turn, so
        both stream at once (the page's A/B race); each reply's decode rates leave out the
        time the others ran. Replies in the same mode share an engine, and so run one after
        the other. A request that fails its checks ends with its error; the others run."""
        handles = [self._handle(*request) for request in requests]
        live = [handle for handle in handles if self._queued(handle)]
        if live:
            self.requests.put(_Race(live))
        return handles

    def _handle(self, conversation_id, messages, mode, settings) -> RequestHandle:
        """A new request's handle: the preset's mode and settings where none are given."""
        return RequestHandle(next(self.ids), str(conversation_id), list(messages or []),
                             mode or self.preset.mode,
                             settings if settings is not None else self.default_settings())

    def _queued(self, handle: RequestHandle) -> bool:
        """Check and tokenize a new request (``prepare``) and add it to the waiting list;
        False, with its error event, if it fails its checks."""
        try:
            handle.prompt = self.prepare(handle)
        except RequestError as err:
            handle.emit("error", str(err), reason="invalid_request")
            return False
        with self.pending_lock:
            self.pending.append(handle)
            position = len(self.pending) - 1 + (1 if self.busy.is_set() else 0)
        handle.emit("queued", position=position, warming_up=self.warming_mode())
        return True

    def prepare(self, handle: RequestHandle) -> list[int]:
        """Every check a request can fail before it runs; returns its prompt ids."""
        if handle.mode not in MODES:
            raise RequestError(f"unknown mode {handle.mode!r}; use one of {', '.join(MODES)}")
        settings = handle.settings
        if not isinstance(settings, GenerationSettings):
            raise RequestError("settings must be a unimax GenerationSettings")
        context = self.preset.max_context
        if handle.tokens is not None:
            prompt = self.check_tokens(handle.tokens)
        elif handle.text is not None:
            check_text(handle.text, max_chars=MAX_CHARS_PER_TOKEN * context)
            with self.tokenizer_lock:
                prompt = encode_text(self.tokenizer, handle.text)
        else:
            check_messages(handle.messages, max_chars=MAX_CHARS_PER_TOKEN * context,
                           extra_chars=len(json.dumps(handle.tools)) if handle.tools else 0)
            with self.tokenizer_lock:
                prompt = self.render(handle.messages, settings.thinking, handle.tools)
                tail = self.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
                handle.keep_at = history_end(self.tokenizer, handle.messages, prompt,
                                             self._thinking(settings.thinking), handle.tools)
            handle.thinking_open = opens_thinking(tail)
        if len(prompt) >= context:
            raise RequestError(f"the conversation is {len(prompt)} tokens, over this model's "
                               f"context setting of {context}; clear the chat, shorten the "
                               "message, or raise max_context in the preset")
        if handle.response_format is not None:
            if not isinstance(handle.response_format, (ResponseFormat, ToolCallFormat)):
                raise RequestError("response_format must be a unimax ResponseFormat "
                                   "(structured.response_format reads OpenAI's) or "
                                   "ToolCallFormat")
            if handle.thinking_open and settings.penalties().active:
                raise RequestError("penalties (presence, frequency, repetition) with a "
                                   "response_format after a thinking block are not served; "
                                   "turn thinking off, or drop the penalties")
            handle.grammar = self.grammars.compile(handle.response_format)
        return prompt

    def check_tokens(self, tokens) -> list[int]:
        """A prompt of token ids: a non-empty list of this model's ids."""
        vocab = self.model.config.vocab_size
        if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError("a token prompt must be a non-empty list of integer token ids")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside this model's vocabulary "
                               f"(0..{vocab - 1})")
        return list(tokens)

    def decode(self, tokens: list[int]) -> str:
        """Token ids as text, special tokens left out (an echoed token prompt)."""
        with self.tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def default_settings(self) -> GenerationSettings:
        return replace(self.preset.generation, thinking=self.preset.enable_thinking)

    def queue_position(self, handle: RequestHandle) -> int:
        """Requests ahead of this one (0: it runs next or is running)."""
        with self.pending_lock:
            if handle not in self.pending:
                return 0
            return self.pending.index(handle) + (1 if self.busy.is_set() else 0)

    def stats_snapshot(self) -> dict:
        with self.stats_lock:
            return dict(self.latest_stats)

    def forget(self, conversation_id: str) -> None:
        self.store.forget(conversation_id)

    # --- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:
                return
            if isinstance(item, _Task):
                try:
                    item.fn()
                except Exception:  # capture and tuning can wait; serving goes on
                    log.exception("start-up work on the engine thread failed")
                finally:
                    item.done.set()
                continue
            handles = item.handles if isinstance(item, _Race) else [item]
            warming = self.warming_mode()  # (stats_lock: never taken inside pending_lock)
            with self.pending_lock:
                for handle in handles:
                    if handle in self.pending:
                        self.pending.remove(handle)
                self.busy.set()
                for waiting in self.pending:
                    waiting.emit("queued", position=self.pending.index(waiting) + 1,
                                 warming_up=warming)
            try:
                if len({handle.mode for handle in handles}) == len(handles) > 1:
                    self._race(handles)
                else:  # (one engine cannot hold two replies at once)
                    for handle in handles:
                        self._run(handle)
            finally:
                self.busy.clear()

    def _run(self, handle: RequestHandle) -> None:
        """Serve one reply on this thread; its failure ends it with an error event, never the
        engine thread."""
        try:
            if handle.cancelled.is_set():
                handle.emit("done", stopped="cancelled")
            else:
                self._serve(handle)
        except RequestError as err:
            handle.emit("error", str(err), reason="invalid_request")
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            handle.emit("error", "the GPU ran out of memory during this reply; try fewer "
                                 "new tokens, a shorter conversation or a smaller model. "
                                 "Other conversations are unaffected.",
                        reason="out_of_memory")
        except Exception as err:  # the thread must outlive any one request
            log.exception("request %s failed", handle.id)
            handle.emit("error", f"internal error: {type(err).__name__}: {err}",
                        reason="internal")
        finally:
            for listener in self.listeners if not handle.internal else ():
                try:
                    listener(handle)
                except Exception:
                    log.exception("a request listener failed")

    def _race(self, handles: list[RequestHandle]) -> None:
        """Replies in different modes (each its own engine: decoder, draft and graphs), a block
        each in turn: each runs on a thread of its own, but only the one holding the baton
        runs, so the GPU's work stays one stream of blocks as the engine thread's own would
        be. The exact side is one for all modes: at each turn a reply parks its exact state
        and KV entries and takes them back when its turn comes again. The engine thread waits
        for all of them."""
        baton = _Baton(len(handles))

        def run(racer: int, handle: RequestHandle) -> None:
            def between_blocks() -> None:
                # this reply's queued work first (verified mode queues its next drafts before
                # the host reads a block): the other reply starts on an idle GPU, and neither
                # is timed with the other's work
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                parked = self._park(handle) if len(baton.order) > 1 else None
                baton.pass_on(racer)
                baton.wait(racer)
                if parked is not None:
                    self.exact.unpark(parked)
                handle.waited += time.perf_counter() - start

            baton.wait(racer)
            handle.between_blocks = between_blocks
            try:
                with torch.cuda.device(self.device) if self.device.type == "cuda" else \
                        contextlib.nullcontext():
                    self._run(handle)
            finally:
                handle.between_blocks = None
                baton.pass_on(racer, leave=True)

        if self.racers is None:  # (kept: a thread's first CUDA and cuBLAS use costs ms)
            self.racers = concurrent.futures.ThreadPoolExecutor(len(MODES), "unimax-race")
        # (one thread per racer, all at once: a racer left waiting for a thread would hold
        # the others at the baton; replies in one race have distinct modes)
        assert len(handles) <= len(MODES)
        for future in [self.racers.submit(run, n, handle) for n, handle in enumerate(handles)]:
            try:
                future.result()
            except Exception:  # (each reply's own failure is its error event: _run)
                log.exception("a race's thread failed")

    def _park(self, handle: RequestHandle):
        """``handle``'s exact state set aside for another racer's turn: the state and the KV
        entries up to the furthest position its caches reached, and a block past it (verified
        mode's next drafts, queued ahead, wrote their KV there)."""
        decoder = self.engines[handle.mode].decode_graph.cache
        cache = self.exact.cache
        reached = max(int(cache.position), int(decoder.position), cache.seen_tokens,
                      decoder.seen_tokens)
        return self.exact.park(reached + self.preset.block_size + 2)

    def _engine(self, mode: str):
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if mode not in self.engines:
            p, spec = self.preset, APP_MODES[mode]
            self.engines[mode] = build_engine(self.model, decode=spec.decode,
                                              draft=spec.draft or p.draft,
                                              block_size=p.block_size,
                                              compile_step=p.compile_step,
                                              prefill_chunk=p.prefill_chunk,
                                              exact=self.exact_side())
        return self.engines[mode]

    def exact_side(self) -> ExactSide:
        """The exact side every mode's engine shares (unimax.exact), built at first use."""
        if self.exact is None:
            self.exact = ExactSide(self.model)
        return self.exact

    def render(self, messages: list[dict], thinking: bool | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids for a conversation ending with a user message."""
        return encode_chat(self.tokenizer, messages, self._thinking(thinking), tools)

    @staticmethod
    def _raw(handle: RequestHandle) -> bool:
        """A prompt given as text or token ids, with no chat template: a completion."""
        return handle.text is not None or handle.tokens is not None

    def _thinking(self, thinking: bool | None) -> bool | None:
        return self.preset.enable_thinking if thinking is None else thinking

    @torch.inference_mode()
    def _serve(self, handle: RequestHandle) -> None:
        if handle.logprobs is not None:
            self._serve_exact(handle)
            return
        engine = self._engine(handle.mode)
        started = time.perf_counter()
        settings = handle.settings
        prompt = handle.prompt  # checked and tokenized by submit()
        max_new = min(settings.max_new_tokens, self.preset.max_context - len(prompt))
        sampling = settings.sampling()
        mode = APP_MODES[handle.mode].engine_mode

        ckpt = self.store.best_prefix(handle.conversation_id, prompt)
        if ckpt is not None:
            self.store.restore(ckpt, engine.exact_cache)
            new_tokens = prompt[len(ckpt.tokens):]
        else:
            new_tokens = prompt
        handle.emit("started", prefill_tokens=len(new_tokens), reused_tokens=len(prompt) -
                    len(new_tokens), thinking_open=handle.thinking_open)
        # a raw prompt's completion goes on from the prompt's text (its first word keeps its
        # leading space); a chat reply starts a turn of its own
        detok = IncrementalDetokenizer(self.tokenizer, prompt[-1] if self._raw(handle) else None,
                                       hidden=self.stop_ids)
        constraint = self._constraint(handle)
        curve: list[list[float]] = []
        timing = {"first": None, "last": None}

        def on_block(tokens: list[int]) -> bool:
            now = time.perf_counter()
            if timing["first"] is None:
                timing["first"] = now
            else:
                # The running decode rate (tokens after the first over the time since it), the
                # panel's decode tok/s as the reply grows: a short last block is not a slowdown.
                emitted = len(detok.tokens) + len(tokens)
                rate = (emitted - 1) / max(now - timing["first"] - handle.waited, 1e-9)
                curve.append([emitted, round(rate, 2)])
            timing["last"] = now
            delta = detok.add(tokens)
            if delta:
                handle.emit("delta", delta)
            self._publish(handle, engine, None, len(new_tokens), len(prompt), detok, curve,
                          started, timing)
            if handle.between_blocks is not None and not handle.cancelled.is_set():
                handle.between_blocks()  # a race: the other replies' turns
            return not handle.cancelled.is_set()

        def on_prefill(done: int, total: int) -> bool:
            if done < total:  # a long prompt, between chunks: progress, and Stop works here
                handle.emit("prefill", done=done, total=total)
            return not handle.cancelled.is_set()

        reused = len(prompt) - len(new_tokens)
        checkpoint = None
        if handle.keep_at is not None and handle.keep_at > reused:
            # later turns render this reply otherwise: keep the state where they part
            checkpoint = (handle.keep_at - reused, lambda: self.store.save(
                handle.conversation_id, prompt[:handle.keep_at], engine.exact_cache))
        elif (handle.tools or handle.grammar is not None) and handle.keep_at is None:
            # an agent's loop: the next request re-sends this one with the reply's calls as the
            # template writes them, which may differ from the model's text by a blank (and a
            # grammar's tokens from the re-encoded text's); the state after the prompt still
            # starts it
            checkpoint = (len(new_tokens), lambda: self.store.save(
                handle.conversation_id, prompt, engine.exact_cache))
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        result = engine.generate(ids, max_new, mode=mode, stop_ids=self.stop_ids,
                                 sampling=sampling, keep_state=ckpt is not None,
                                 on_block=on_block, on_prefill=on_prefill,
                                 checkpoint=checkpoint, constraint=constraint,
                                 penalties=settings.penalties(), penalized_prompt=prompt)
        tail = detok.flush()
        if tail:
            handle.emit("delta", tail)
        if result.tokens and handle.keep_at is None:
            # the exact cache holds prompt + reply: the state this request computed
            self.store.save(handle.conversation_id, prompt + result.tokens, engine.exact_cache)
        stats = self._publish(handle, engine, result, len(new_tokens), len(prompt), detok, curve,
                              started, timing)
        handle.emit("done", stopped=result.stopped, stats=stats, reply=detok.text,
                    tokens=result.tokens[:-1] if result.stopped == "stop" else result.tokens)

    def _constraint(self, handle: RequestHandle) -> Constraint | None:
        """The reply's grammar state; behind an open thinking block, off until the token
        after the block's end (reasoning.ThinkingEnd)."""
        if handle.grammar is None:
            return None
        opens = ThinkingEnd(self.tokenizer, handle.prompt[-1] if self._raw(handle) else None)
        return Constraint(handle.grammar, self.model.config.vocab_size,
                          active=not handle.thinking_open, opens=opens)

    def _serve_exact(self, handle: RequestHandle) -> None:
        """A request for log-probabilities, on the exact model's eager forward (logprobs.py):
        the engines' graphs hand back tokens, not distributions. Held to a grammar as well
        (``response_format``), each token's logits are masked before it is chosen. Its cache is
        its own, but its attention layers borrow the exact side's KV buffers (no second
        max_context buffer for a hybrid): every other request restores or resets its state
        before it runs. It starts from an empty state, on purpose: the prompt's figures must
        come from this prefill. Events: "prompt" (with echo: the prompt's text and entries),
        then a "delta" per token with its entry."""
        want, settings, prompt = handle.logprobs or LogprobsRequest(), handle.settings, \
            handle.prompt
        constraint = self._constraint(handle)
        cache = self.exact_side().cache.empty_like(share_kv=True)
        started = time.perf_counter()
        handle.emit("started", prefill_tokens=len(prompt), reused_tokens=0,
                    thinking_open=handle.thinking_open)
        # every position's logits only when the prompt is scored; else the prefill's chunks
        chunk = score_chunk(self.model.config.vocab_size, self.preset.prefill_chunk) \
            if want.prompt else self.preset.prefill_chunk
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        entries, logits = logprobs.prefill(self.model, cache, ids,
                                           want.top if want.prompt else None, chunk)
        prefilled = time.perf_counter()
        if want.prompt:
            echo = EntryText(self.tokenizer)
            items = [echo.add(entry)[0] for entry in entries]
            echo.flush()
            handle.emit("prompt", echo.text, logprobs=items)
        reply = EntryText(self.tokenizer, previous=prompt[-1], continues=self._raw(handle))
        times: list[float] = []

        def on_token(entry) -> bool:
            times.append(time.perf_counter())
            item, delta = reply.add(entry)
            handle.emit("delta", delta, logprobs=[item])
            return not handle.cancelled.is_set()

        max_new = min(settings.max_new_tokens, self.preset.max_context - len(prompt))
        generator = torch.Generator()
        if settings.seed is not None:
            generator.manual_seed(settings.seed)
        else:
            generator.seed()
        tokens, stopped = [], "cancelled"
        if not handle.cancelled.is_set():
            tokens, stopped = logprobs.generate(
                self.model, cache, logits, max_new if want.generate else 0, want.top,
                stop_ids=self.stop_ids, sampling=settings.sampling(), generator=generator,
                on_token=on_token, constraint=constraint, penalties=settings.penalties(),
                prompt=prompt)
        tail = reply.flush()
        if tail:
            handle.emit("delta", tail)
        stats = {"mode": "exact", "requested_mode": handle.mode,
                 "conversation_id": handle.conversation_id,
                 "prefilled_tokens": len(prompt), "reused_tokens": 0,
                 "generated_tokens": len(tokens), "bridge_mib": None,
                 "bridge_ms": None, "acceptance_rate": None, "device": str(self.device),
                 "prefill_tok_s": round(len(prompt) / max(prefilled - started, 1e-9), 1),
                 "ttft_ms": round((times[0] - started) * 1e3, 2) if times else None,
                 "decode_tok_s": round((len(times) - 1) / max(times[-1] - times[0], 1e-9), 2)
                 if len(times) > 1 else None, "stopped": stopped,
                 "response_format": handle.response_format and handle.response_format.kind}
        with self.stats_lock:
            self.latest_stats = stats
        handle.emit("stats", stats=stats)
        handle.emit("done", stopped=stopped, stats=stats, reply=reply.text,
                    tokens=[entry.token for entry in tokens])

    def _publish(self, handle, engine, result, prefilled, prompt_len, detok, curve, started,
                 timing) -> dict:
        bridge = engine.last_bridge
        stats = {
            "mode": handle.mode, "conversation_id": handle.conversation_id,
            "prefilled_tokens": prefilled, "reused_tokens": prompt_len - prefilled,
            "generated_tokens": len(detok.tokens),
            "bridge_mib": round(bridge.mib, 3) if bridge else None,
            "bridge_ms": round(bridge.seconds * 1e3, 3) if bridge else None,
            "ttft_ms": round((timing["first"] - started) * 1e3, 2) if timing["first"] else None,
            "decode_curve": list(curve), "device": str(self.device),
            "response_format": handle.response_format and handle.response_format.kind,
        }
        # (a race's waits for the other replies are left out: each side's own speed)
        if timing["first"] and timing["last"] and len(detok.tokens) > 1:
            stats["decode_tok_s"] = round((len(detok.tokens) - 1) / max(
                timing["last"] - timing["first"] - handle.waited, 1e-9), 2)
        current = result or getattr(engine, "current_generation", None)
        if current is not None and current.prefill_seconds > 0:
            stats["prefill_tok_s"] = round(current.prefill_tokens / current.prefill_seconds, 1)
        if result is not None:
            if len(result.tokens) > 1:
                stats["decode_tok_s"] = round((len(result.tokens) - 1) /
                                              max(result.decode_seconds - handle.waited, 1e-9),
                                              2)
            stats["stopped"] = result.stopped
            if result.verify is not None:
                stats.update({k: v for k, v in asdict(result.verify).items()})
                # No drafts (the policy took exact steps only): no acceptance to show.
                stats["acceptance_rate"] = (round(result.verify.acceptance_rate, 4)
                                            if result.verify.drafted_tokens else None)
                stats["mean_draft_length"] = round(result.verify.mean_draft_length, 2)
        stats.setdefault("acceptance_rate", None)
        stats.setdefault("prefill_tok_s", None)
        stats.setdefault("decode_tok_s", None)
        if result is not None:
            stats["kept_states"] = self.store.usage()
        with self.stats_lock:
            self.latest_stats = stats
        handle.emit("stats", stats=stats)
        return stats
