"""The Gradio page: chat with modes and settings, live panels, A/B comparison, and the stable API
endpoints /chat and /stats. It talks to the EngineService only; panels read stats snapshots and
never touch the GPU."""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from unimax.modes import APP_MODES, MODES
from unimax.presets import Preset
from unimax.service import EngineService
from unimax.settings import GenerationSettings

from .panels import ab_summary, curve_frame, first_char_difference, highlighted, panel_markdown

MODE_CHOICES = [(mode.label, mode.name) for mode in APP_MODES.values()]
CSS = """
#panels table { font-size: 0.9em; }
mark.ab-diverge { background: #ffd54f; }
pre.ab-text { white-space: pre-wrap; word-break: break-word; min-height: 3em; }
"""


class Sessions:
    """Per browser session: the request in flight (so Stop and a closed tab can cancel it) and
    the latest stats (what this page's panels show)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.handles: dict[str, object] = {}
        self.stats: dict[str, dict] = {}
        self.epochs: dict[str, int] = {}  # bumped by Clear: older replies stop writing

    def epoch(self, session: str) -> int:
        with self.lock:
            return self.epochs.get(session, 0)

    def bump(self, session: str) -> None:
        with self.lock:
            self.epochs[session] = self.epochs.get(session, 0) + 1

    def start(self, session: str, handle) -> None:
        with self.lock:
            self.handles[session] = handle

    def running(self, session: str) -> bool:
        """Whether a reply started after the last Stop / Clear is in flight in this session."""
        with self.lock:
            handle = self.handles.get(session)
        return handle is not None and not handle.finished.is_set()

    def cancel(self, session: str) -> bool:
        """Cancel this session's reply; False when none was running (it had finished)."""
        with self.lock:
            handle = self.handles.pop(session, None)
        if handle is None or handle.finished.is_set():
            return False
        handle.cancel()
        return True

    def set_stats(self, session: str, stats: dict) -> None:
        with self.lock:
            self.stats[session] = stats

    def get_stats(self, session: str) -> dict:
        with self.lock:
            return dict(self.stats.get(session, {}))

    def collect_final(self, session: str, handle) -> None:
        if handle.finished.wait(30):
            for event in list(handle.queue.queue):
                if event.kind == "stats":
                    self.set_stats(session, event.data["stats"])

    def close(self, session: str) -> None:
        self.cancel(session)
        with self.lock:
            self.stats.pop(session, None)


def has_thinking_switch(tokenizer) -> bool:
    """Whether the chat template reads the thinking switch (Qwen3.5's enable_thinking)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "enable_thinking" in template


def done_status(stopped: str | None) -> str:
    """The status line when a reply ends, by how it ended."""
    return {"cancelled": "Stopped.", "stop": "Done: the model ended its turn.",
            "length": "Done: reached the max new tokens setting."}.get(
                stopped, f"Done ({stopped}).")


def settings_from(temperature, top_p, top_k, max_new_tokens, seed,
                  thinking=None) -> GenerationSettings:
    seed = None if seed in (None, "") else int(seed)
    return GenerationSettings(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                              top_p=float(top_p), top_k=int(top_k), seed=seed,
                              thinking=None if thinking is None else bool(thinking))


class Exports:
    """Export files in one folder of the app's own, removed when the app exits; files older
    than ``max_age_s`` go at each new export (Gradio serves its own copy of each, which its
    cache clean-up removes: see build_demo)."""

    def __init__(self, max_age_s: float = 600.0):
        self.folder = Path(tempfile.mkdtemp(prefix="unimax-exports-"))
        self.max_age_s = max_age_s
        atexit.register(shutil.rmtree, self.folder, ignore_errors=True)

    def write(self, data: dict) -> str:
        now = time.time()
        for old in self.folder.glob("*.json"):
            if now - old.stat().st_mtime > self.max_age_s:
                old.unlink(missing_ok=True)
        path = self.folder / f"unimax-chat-{uuid.uuid4().hex[:12]}.json"
        path.write_text(json.dumps(data, indent=1))
        return str(path)


def build_demo(service: EngineService, preset: Preset) -> gr.Blocks:
    sessions = Sessions()
    exports = Exports()
    g = preset.generation
    info = (f"**UNI MAX** · model `{preset.model}` on `{service.device}` · preset "
            f"`{preset.name}` · block {preset.block_size} · verified draft `{preset.draft}`")

    def stream(session, conversation_id, messages, mode, settings) -> Iterator[tuple]:
        """Yields (kind, text, data) from one request; cancels it if the consumer goes away."""
        # (before the page's load event has set the id, the tab's session stands in for it)
        handle = service.submit(conversation_id or f"session-{session}", messages, mode,
                                settings)
        sessions.start(session, handle)
        try:
            for event in handle.events():
                if event.kind == "stats":
                    sessions.set_stats(session, event.data["stats"])
                yield event.kind, event.text, event.data
        finally:
            if not handle.finished.is_set():
                handle.cancel()  # Stop, a closed tab, or an error in the page: free the GPU
                # The engine ends it within one block; its final stats still reach the panels
                # (collected off this generator, which Gradio is closing).
                threading.Thread(target=sessions.collect_final, args=(session, handle),
                                 daemon=True).start()

    # --- chat ------------------------------------------------------------------------------

    def send(message, history, conversation_id, mode, system, temperature, top_p, top_k,
             max_new, seed, thinking, request: gr.Request):
        history = list(history or [])
        if not message or not message.strip():
            yield history, message, "⚠️ Empty message: type something to send."
            return
        history.append({"role": "user", "content": message})
        yield from reply(history, conversation_id, mode, system, temperature, top_p, top_k,
                         max_new, seed, thinking, request, sent=message)

    def reply(history, conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
              thinking, request, sent: str | None = None):
        """Stream a reply to ``history``. ``sent``: the message the user just sent; if the
        request is refused, it leaves the chat and goes back into the box, so it cannot poison
        the next Send or Regenerate."""
        box = gr.update() if sent is None else ""
        try:
            settings = settings_from(temperature, top_p, top_k, max_new, seed, thinking)
        except (TypeError, ValueError) as err:
            if sent is not None:  # not sent after all: back into the box
                history, box = history[:-1], sent
            yield history, box, f"⚠️ Bad setting: {err}"
            return
        messages = ([{"role": "system", "content": system}] if system and system.strip()
                    else []) + [{"role": m["role"], "content": _text(m["content"])}
                                for m in history]
        history = history + [{"role": "assistant", "content": ""}]
        status = "Sending…"
        yield history, box, status
        epoch = sessions.epoch(request.session_hash)
        for kind, text, data in stream(request.session_hash, conversation_id, messages, mode,
                                       settings):
            if sessions.epoch(request.session_hash) != epoch:
                # Cleared meanwhile. This event's outputs may land after Clear's: end on what
                # Clear shows, so Clear wins whatever the order, unless the user has already
                # sent something new (that reply owns the page now).
                if not sessions.running(request.session_hash):
                    yield [], "", "Cleared."
                return
            if kind == "queued" and data.get("position"):
                status = f"⏳ Waiting for the GPU: {data['position']} request(s) ahead."
            elif kind == "started":
                status = f"Generating ({mode}) · prefilling {data['prefill_tokens']} new " \
                         f"tokens, reusing {data['reused_tokens']} from the kept state…"
            elif kind == "delta":
                history[-1] = {"role": "assistant", "content": history[-1]["content"] + text}
            elif kind == "error":
                refused = sent is not None and not history[-1]["content"]
                history = history[:-2] if refused else history[:-1]
                box = sent if refused else box
                status = f"⚠️ {text}"
            elif kind == "done":
                status = done_status(data.get("stopped"))
            else:
                continue
            yield history, box, status

    def regenerate(history, conversation_id, mode, system, temperature, top_p, top_k, max_new,
                   seed, thinking, request: gr.Request):
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            yield history, gr.update(), "Nothing to regenerate yet."
            return
        yield from reply(history, conversation_id, mode, system, temperature, top_p, top_k,
                         max_new, seed, thinking, request)

    def edited(history, conversation_id, mode, system, temperature, top_p, top_k, max_new,
               seed, thinking, edit: gr.EditData, request: gr.Request):
        history = list(history or [])[: edit.index + 1]
        history[-1] = {"role": "user", "content": edit.value}
        yield from reply(history, conversation_id, mode, system, temperature, top_p, top_k,
                         max_new, seed, thinking, request)

    def clear(conversation_id, request: gr.Request):
        sessions.bump(request.session_hash)
        sessions.cancel(request.session_hash)
        sessions.set_stats(request.session_hash, {})  # the panels start over too
        service.forget(conversation_id)
        return [], str(uuid.uuid4()), "Cleared."

    def export(history, system, mode):
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in history or []]
        data = {"model": preset.model, "mode": mode, "system": system, "messages": messages}
        return exports.write(data)

    def stop(request: gr.Request):
        if sessions.cancel(request.session_hash):
            return "Stopped."
        return "Nothing to stop: the reply had already finished."

    def panels(request: gr.Request):
        stats = sessions.get_stats(request.session_hash)
        frame = curve_frame(stats)
        if frame.empty:
            return panel_markdown(stats), gr.update(visible=False)
        # Axes from zero: a reply of one or two blocks would get a degenerate, clipped axis.
        return panel_markdown(stats), gr.update(
            value=frame, visible=True, x_lim=[0, float(frame["tokens"].max())],
            y_lim=[0, float(frame["tok_s"].max()) * 1.25])

    # --- A/B -------------------------------------------------------------------------------

    def run_ab(prompt, mode_a, mode_b, temperature, top_p, top_k, max_new, seed, thinking,
               request: gr.Request):
        empty = ("", "", "", "", "")
        if not prompt or not prompt.strip():
            yield ("⚠️ Empty prompt: type something to compare.", *empty[1:])
            return
        try:
            settings = settings_from(temperature, top_p, top_k, max_new, seed, thinking)
        except (TypeError, ValueError) as err:
            yield (f"⚠️ Bad setting: {err}", *empty[1:])
            return
        if settings.seed is None:  # both sides must draw the same random numbers
            settings = dataclasses.replace(settings, seed=0)
        texts, stats = {"a": "", "b": ""}, {"a": {}, "b": {}}
        messages = [{"role": "user", "content": prompt}]
        for side, mode in (("a", mode_a), ("b", mode_b)):
            conversation = f"ab-{uuid.uuid4()}"
            for kind, text, data in stream(request.session_hash, conversation, messages, mode,
                                           settings):
                if kind == "delta":
                    texts[side] += text
                elif kind == "stats":
                    stats[side] = data["stats"]
                elif kind == "error":
                    yield (f"⚠️ {mode}: {text}", highlighted(texts["a"], None),
                           highlighted(texts["b"], None), panel_markdown(stats["a"]),
                           panel_markdown(stats["b"]))
                    return
                yield (f"Running {mode} ({side.upper()})…", highlighted(texts["a"], None),
                       highlighted(texts["b"], None), panel_markdown(stats["a"]),
                       panel_markdown(stats["b"]))
            service.forget(conversation)
        start = first_char_difference(texts["a"], texts["b"])
        yield (ab_summary(mode_a, texts["a"], stats["a"], mode_b, texts["b"], stats["b"]),
               highlighted(texts["a"], start), highlighted(texts["b"], start),
               panel_markdown(stats["a"]), panel_markdown(stats["b"]))

    # --- layout ----------------------------------------------------------------------------

    # delete_cache: Gradio's copies of served files (exports) older than 10 min go every 10 min.
    with gr.Blocks(title="UNI MAX", delete_cache=(600, 600)) as demo:
        gr.Markdown(info, elem_id="header")
        conversation_id = gr.State()  # a new id per page load (demo.load below)
        with gr.Row():
            with gr.Column(scale=2):
                mode = gr.Radio(MODE_CHOICES, value=preset.mode, label="Mode", elem_id="mode")
                system = gr.Textbox(preset.system_prompt, label="System prompt", lines=2)
                with gr.Accordion("Generation", open=False):
                    temperature = gr.Slider(0, 2, value=g.temperature, step=0.05,
                                            label="Temperature (0 = greedy)")
                    top_p = gr.Slider(0.05, 1, value=g.top_p, step=0.05, label="Top-p")
                    top_k = gr.Slider(0, 200, value=g.top_k, step=1, label="Top-k (0 = off)")
                    max_new = gr.Slider(1, min(4096, preset.max_context),
                                        value=min(g.max_new_tokens, preset.max_context), step=1,
                                        label="Max new tokens")
                    seed = gr.Number(g.seed, label="Seed (empty = random)", precision=0)
                    thinking = gr.Checkbox(bool(preset.enable_thinking), label="Thinking",
                                           visible=has_thinking_switch(service.tokenizer))
            with gr.Column(scale=5):
                with gr.Tab("Chat"):
                    chatbot = gr.Chatbot(height=420, label="Chat", editable="user",
                                         elem_id="chatbot")
                    message = gr.Textbox(placeholder="Message (Enter to send)", show_label=False,
                                         elem_id="message")
                    with gr.Row():
                        send_btn = gr.Button("Send", variant="primary", elem_id="send")
                        stop_btn = gr.Button("Stop", elem_id="stop")
                        regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                        clear_btn = gr.Button("Clear", elem_id="clear")
                        export_btn = gr.Button("Export JSON", elem_id="export")
                    status = gr.Markdown("", elem_id="status")
                    export_file = gr.File(label="Exported conversation", visible=True,
                                          elem_id="export-file")
                with gr.Tab("A/B", elem_id="ab-tab"):
                    ab_prompt = gr.Textbox(label="Prompt", elem_id="ab-prompt")
                    with gr.Row():
                        mode_a = gr.Dropdown(MODE_CHOICES, value="bf16", label="Mode A")
                        mode_b = gr.Dropdown(MODE_CHOICES, value="fp8", label="Mode B")
                        ab_btn = gr.Button("Compare", variant="primary", elem_id="ab-run")
                    ab_status = gr.Markdown("", elem_id="ab-status")
                    with gr.Row():  # side by side from ~1000 px wide windows
                        with gr.Column(min_width=160):
                            gr.Markdown("**A**")
                            ab_text_a = gr.HTML(elem_id="ab-a")
                            ab_stats_a = gr.Markdown(elem_id="ab-stats-a")
                        with gr.Column(min_width=160):
                            gr.Markdown("**B**")
                            ab_text_b = gr.HTML(elem_id="ab-b")
                            ab_stats_b = gr.Markdown(elem_id="ab-stats-b")
            with gr.Column(scale=3, elem_id="panels"):
                gr.Markdown("### Live panels")
                panel = gr.Markdown(panel_markdown(None), elem_id="panel")
                # Hidden while empty: the chart library warns about an empty plot's extents.
                plot = gr.LinePlot(curve_frame(None), x="tokens", y="tok_s", height=200,
                                   title="decode tok/s so far, over the reply", elem_id="plot",
                                   visible=False)

        gen_inputs = [conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
                      thinking]
        chat_outputs = [chatbot, message, status]
        # Stop and Clear cancel through the service (the reply ends within one block and its
        # generator finishes normally), not through Gradio's cancels=, which can leave the
        # outputs showing an error.
        # The page's own events stay out of the API page (callable, undocumented): scripts use
        # /chat and /stats below, or the OpenAI API.
        page = dict(api_visibility="undocumented")
        send_btn.click(send, [message, chatbot, *gen_inputs], chat_outputs,
                       concurrency_limit=None, **page)
        message.submit(send, [message, chatbot, *gen_inputs], chat_outputs,
                       concurrency_limit=None, **page)
        regen_btn.click(regenerate, [chatbot, *gen_inputs], chat_outputs, concurrency_limit=None,
                        **page)
        chatbot.edit(edited, [chatbot, *gen_inputs], chat_outputs, concurrency_limit=None,
                     **page)
        stop_btn.click(stop, None, status, queue=False, **page)
        clear_btn.click(clear, conversation_id, [chatbot, conversation_id, status], queue=False,
                        **page)
        export_btn.click(export, [chatbot, system, mode], export_file, **page)
        ab_btn.click(run_ab, [ab_prompt, mode_a, mode_b, temperature, top_p, top_k, max_new,
                              seed, thinking],
                     [ab_status, ab_text_a, ab_text_b, ab_stats_a, ab_stats_b],
                     concurrency_limit=None, **page)
        timer = gr.Timer(0.5)
        timer.tick(panels, None, [panel, plot], queue=False, show_progress="hidden", **page)
        def closed(request: gr.Request):  # the tab went away: cancel its request
            sessions.close(request.session_hash)

        demo.unload(closed)
        demo.load(lambda: str(uuid.uuid4()), None, conversation_id, api_visibility="undocumented")

        # --- stable script endpoints ---------------------------------------------------------

        def chat(message: str, mode: str, request: gr.Request) -> Iterator[str]:
            """Stream the assistant's reply to a one-turn conversation. mode: bf16, fp8 or
            verified."""
            if mode not in MODES:
                raise gr.Error(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
            if not isinstance(message, str) or not message.strip():
                raise gr.Error("empty message: send some text")
            conversation = f"api-{uuid.uuid4()}"
            text = ""
            try:
                for kind, delta, _ in stream(request.session_hash, conversation,
                                                [{"role": "user", "content": message}], mode,
                                                service.default_settings()):
                    if kind == "delta":
                        text += delta
                        yield text
                    elif kind == "error":
                        raise gr.Error(delta)
                yield text
            finally:
                service.forget(conversation)

        def stats(request: gr.Request) -> dict:
            """This client's latest reply's stats: mode, bridge_mib, bridge_ms,
            acceptance_rate, decode_tok_s, prefill_tok_s, ttft_ms, prefilled_tokens, ..."""
            mine = sessions.get_stats(request.session_hash)  # nobody else's, no ids
            mine.pop("conversation_id", None)
            return mine or {"mode": None}

        gr.api(chat, api_name="chat", concurrency_limit=None)
        gr.api(stats, api_name="stats", queue=False)
    return demo


def _text(content) -> str:
    """Chatbot message content as plain text (Gradio may hand back structured content)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    return str(content)
