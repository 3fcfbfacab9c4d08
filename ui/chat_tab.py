"""The Chat tab's handlers: send, regenerate, edit, stop, clear, export, and the panels' timer.
Each generation handler takes the page's settings widgets in one fixed order (``GEN_INPUTS`` in
page.py) and bundles them into a ``Gen``."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import gradio as gr

from unimax.presets import Preset
from unimax.reasoning import ThinkSplitter
from unimax.service import EngineService
from unimax.settings import GenerationSettings

from .display import raw
from .panels import curve_svg, panel_markdown, warm_up_line
from .sessions import Sessions, stream


class Gen(NamedTuple):
    """The settings widgets' values, in the order the page passes them."""
    conversation_id: str | None
    mode: str
    system: str
    temperature: float
    top_p: float
    top_k: int
    max_new: int
    seed: float | None
    thinking: bool | None
    min_p: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    def settings(self) -> GenerationSettings:
        return settings_from(self.temperature, self.top_p, self.top_k, self.max_new, self.seed,
                             self.thinking, self.min_p, self.presence, self.repetition)


def done_status(stopped: str | None) -> str:
    """The status line when a reply ends, by how it ended."""
    return {"cancelled": "Stopped.", "stop": "Done: the model ended its turn.",
            "length": "Done: reached the max new tokens setting."}.get(
                stopped, f"Done ({stopped}).")


def settings_from(temperature, top_p, top_k, max_new_tokens, seed,
                  thinking=None, min_p=0.0, presence=0.0, repetition=1.0) -> GenerationSettings:
    seed = parse_seed(seed)
    return GenerationSettings(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                              top_p=float(top_p), top_k=int(top_k), seed=seed,
                              thinking=None if thinking is None else bool(thinking),
                              min_p=float(min_p), presence_penalty=float(presence),
                              repetition_penalty=float(repetition))


def parse_seed(seed) -> int | None:
    """The seed box's text: empty for a random seed, else a whole number (ValueError)."""
    text = "" if seed is None else str(seed).strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"the seed {text!r} is not a whole number >= 0; leave it empty for "
                         "a random one")
    return int(text)


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


class ChatTab:
    def __init__(self, service: EngineService, sessions: Sessions, preset: Preset):
        self.service, self.sessions, self.preset = service, sessions, preset
        self.exports = Exports()

    def send(self, message, history, conversation_id, mode, system, temperature, top_p, top_k,
             max_new, seed, thinking, min_p, presence, repetition, request: gr.Request):
        history = list(history or [])
        if not message or not message.strip():
            yield history, message, "⚠️ Empty message: type something to send."
            return
        if self.sessions.running(request.session_hash):
            # Enter and Send alike (Enter was swallowed by the page, Send cut the reply off);
            # the streaming reply's status keeps saying so (Sessions.notice)
            notice = self.sessions.notice(request.session_hash, STILL_STREAMING)
            yield gr.update(), message, notice
            return
        history.append({"role": "user", "content": message})
        gen = Gen(conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
                  thinking, min_p, presence, repetition)
        yield from self.reply(history, gen, request.session_hash, sent=message)

    def example(self, history, conversation_id, mode, system, temperature, top_p, top_k,
                max_new, seed, thinking, min_p, presence, repetition, picked: gr.SelectData,
                request: gr.Request):
        """One of the preset's examples clicked on the empty chat: sent as if typed."""
        text = picked.value["text"] if isinstance(picked.value, dict) else str(picked.value)
        yield from self.send(text, history, conversation_id, mode, system, temperature, top_p,
                             top_k, max_new, seed, thinking, min_p, presence, repetition,
                             request)

    def regenerate(self, history, conversation_id, mode, system, temperature, top_p, top_k,
                   max_new, seed, thinking, min_p, presence, repetition, request: gr.Request):
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            yield history, gr.update(), "Nothing to regenerate yet."
            return
        gen = Gen(conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
                  thinking, min_p, presence, repetition)
        yield from self.reply(history, gen, request.session_hash)

    def edited(self, history, conversation_id, mode, system, temperature, top_p, top_k,
               max_new, seed, thinking, min_p, presence, repetition, edit: gr.EditData,
               request: gr.Request):
        history = list(history or [])[: edit.index + 1]
        # (the edit box held the shown text: display.raw gives the message as typed)
        history[-1] = {"role": "user", "content": raw(message_text(edit.value))}
        gen = Gen(conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
                  thinking, min_p, presence, repetition)
        yield from self.reply(history, gen, request.session_hash)

    def reply(self, history: list[dict], gen: Gen, session: str, sent: str | None = None):
        """Stream a reply to ``history``. ``sent``: the message the user just sent; if the
        request is refused, it leaves the chat and goes back into the box, so it cannot poison
        the next Send or Regenerate."""
        box = gr.update() if sent is None else ""
        try:
            settings = gen.settings()
        except (TypeError, ValueError) as err:
            if sent is not None:  # not sent after all: back into the box
                history, box = history[:-1], sent
            yield history, box, f"⚠️ Bad setting: {err}"
            return
        messages = ([{"role": "system", "content": gen.system}]
                    if gen.system and gen.system.strip() else []) + [
            {"role": m["role"], "content": message_text(m["content"])} for m in history
            if not _is_thinking(m)]  # (chat templates drop past turns' reasoning too)
        base = history
        # the reply's thinking block (reasoning.py) folds away above its answer
        reply = {"reasoning": "", "answer": "", "splitter": ThinkSplitter(False)}
        history = base + _reply_messages(reply)
        status = "Sending…"
        yield history, box, status
        # The box was emptied once, as the message left it; later updates leave it alone: the
        # user may be typing the next message while this reply streams (each update had reset
        # it to "", wiping what was typed).
        box = gr.update()
        epoch = self.sessions.epoch(session)
        self.sessions.notice(session, "")  # (a new reply: no refused message yet)
        for kind, text, data in stream(self.service, self.sessions, session,
                                       gen.conversation_id, messages, gen.mode, settings):
            if self.sessions.epoch(session) != epoch:  # cleared meanwhile
                yield from self._cleared(session)
                return
            if kind == "queued" and data.get("warming_up"):
                status = f"⏳ The engine is warming up the {data['warming_up']} mode " \
                         "(once per start: compiling, capturing CUDA graphs); your reply " \
                         "starts after it."
            elif kind == "queued" and data.get("position"):
                # (the engine thread, on a GPU or a CPU: "the GPU" was wrong on a CPU)
                status = f"⏳ Waiting for the engine: {data['position']} request(s) ahead."
            elif kind == "started":
                reply["splitter"] = ThinkSplitter(bool(data.get("thinking_open")))
                status = f"Generating ({gen.mode}) · prefilling {data['prefill_tokens']} new " \
                         f"tokens, reusing {data['reused_tokens']} from the kept state…"
            elif kind == "prefill":
                status = f"Generating ({gen.mode}) · prefilling: {data['done']} of " \
                         f"{data['total']} prompt tokens…"
            elif kind == "delta":
                _add(reply, reply["splitter"].feed(text))
                history = base + _reply_messages(reply)
                # not "prefilling" while tokens stream; a message refused meanwhile says why
                status = self.sessions.notice(session) or f"Generating ({gen.mode})…"
            elif kind == "error":
                refused = sent is not None and not (reply["reasoning"] or reply["answer"])
                history = base[:-1] if refused else base
                box = sent if refused else box
                status = f"⚠️ {text}"
            elif kind == "done":
                _add(reply, reply["splitter"].flush())
                history = base + _reply_messages(reply, done=True)
                status = done_status(data.get("stopped"))
            else:
                continue
            yield history, box, status
            box = gr.update()  # (a refused message went back into the box once)
        if self.sessions.epoch(session) != epoch:
            # Clear came after the stream's last event, and that event's update (already
            # yielded) may still land after Clear's own: end on Clear's page here too.
            yield from self._cleared(session)

    def _cleared(self, session: str):
        """What a reply's generator yields last once Clear has run: Clear's page, so Clear wins
        whatever order the two updates land in, unless the user has already sent something
        new (that reply owns the page now). The message box is not Clear's: what the user
        typed since stays."""
        if not self.sessions.running(session):
            yield [], gr.update(), "Cleared."

    def clear(self, conversation_id, request: gr.Request):
        session = request.session_hash
        self.sessions.bump(session)
        self.sessions.cancel(session)
        self.sessions.set_stats(session, {})  # the panels start over too
        self.service.forget(conversation_id)
        return [], str(uuid.uuid4()), "Cleared.", gr.update(value=None, visible=False)

    def export(self, history, system, mode):
        messages = [{"role": m["role"], "content": message_text(m["content"]),
                     **({"thinking": True} if _is_thinking(m) else {})} for m in history or []]
        data = {"model": self.preset.model, "mode": mode, "system": system,
                "messages": messages}
        return gr.update(value=self.exports.write(data), visible=True)

    def stop(self, request: gr.Request):
        if self.sessions.cancel(request.session_hash):
            return "Stopped."
        return "Nothing to stop: the reply had already finished."

    def panels(self, request: gr.Request):
        stats = self.sessions.get_stats(request.session_hash)
        return (warm_up_line(self.service.warm_up_snapshot()) + panel_markdown(stats),
                curve_svg(stats))


THINKING = "Thinking"  # the folded reasoning message's title
STILL_STREAMING = ("⚠️ A reply is still streaming: press Stop, or wait for it to finish, then "
                   "send. (Your message stays in the box.)")


def _is_thinking(message: dict) -> bool:
    metadata = message.get("metadata")
    return isinstance(metadata, dict) and metadata.get("title") == THINKING


def _add(reply: dict, pieces: tuple[str, str]) -> None:
    reply["reasoning"] += pieces[0]
    reply["answer"] += pieces[1]


def _reply_messages(reply: dict, done: bool = False) -> list[dict]:
    """The streaming reply as chat messages: its reasoning (if any, folded, marked pending
    while the block is open) and its answer."""
    thinking = []
    if reply["reasoning"]:
        status = "done" if done or not reply["splitter"].inside else "pending"
        thinking = [{"role": "assistant", "content": reply["reasoning"],
                     "metadata": {"title": THINKING, "status": status}}]
    return thinking + [{"role": "assistant", "content": reply["answer"]}]


def message_text(content) -> str:
    """Chatbot message content as plain text (Gradio may hand back structured content)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(message_text(part) for part in content)
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    return str(content)
