"""The page's chats kept in the browser (Gradio's BrowserState: the browser's localStorage), so a
reload or a closed tab loses nothing: the current chat comes back, earlier ones are listed, and
an exported JSON file (chat_tab.ChatTab.export) can be imported as a chat of its own. Pure
functions on the stored value, and the page's handlers for them (KeptChats; page.py wires
them).

The stored value: {"current": id or None, "chats": [{"id", "title", "messages", "updated"}]},
newest first, at most ``MAX_CHATS``. A chat's id is also its conversation id on the server, so
while the app runs, a chat picked again reuses its kept states."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import gradio as gr

from .chat_tab import THINKING, message_text

MAX_CHATS = 30
MAX_TITLE = 48
MAX_IMPORT_BYTES = 4 << 20


class NotAChat(ValueError):
    """An imported file that is not an exported chat; the message says why."""


def normalized(store) -> dict:
    """The stored value, or an empty store where it is missing or not ours (a browser's
    storage can hold anything)."""
    if not isinstance(store, dict) or not isinstance(store.get("chats"), list):
        return {"current": None, "chats": []}
    chats = [c for c in store["chats"] if isinstance(c, dict) and isinstance(c.get("id"), str)
             and isinstance(c.get("messages"), list)]
    current = store.get("current") if isinstance(store.get("current"), str) else None
    return {"current": current, "chats": chats[:MAX_CHATS]}


def title_of(messages: list[dict]) -> str:
    first = next((m for m in messages if m.get("role") == "user"), None)
    text = " ".join(message_text(first.get("content")).split()) if first else ""
    if not text:
        return "(empty chat)"
    return text if len(text) <= MAX_TITLE else text[:MAX_TITLE - 1] + "…"


def saved(store, chat_id: str | None, messages: list[dict]) -> dict:
    """``store`` with the chat ``chat_id`` holding ``messages`` (moved to the top); an empty
    chat is not kept."""
    store = normalized(store)
    others = [c for c in store["chats"] if c["id"] != chat_id]
    if not chat_id or not messages:
        return {"current": chat_id, "chats": others}
    chat = {"id": chat_id, "title": title_of(messages), "messages": plain(messages),
            "updated": int(time.time())}
    return {"current": chat_id, "chats": [chat, *others][:MAX_CHATS]}


def removed(store, chat_id: str | None) -> dict:
    store = normalized(store)
    return {"current": None, "chats": [c for c in store["chats"] if c["id"] != chat_id]}


def find(store, chat_id: str | None) -> dict | None:
    return next((c for c in normalized(store)["chats"] if c["id"] == chat_id), None)


def choices(store) -> list[tuple[str, str]]:
    """(label, id) of every kept chat, newest first, for the page's list."""
    return [(c.get("title") or "(chat)", c["id"]) for c in normalized(store)["chats"]]


def plain(messages: list[dict]) -> list[dict]:
    """Chat messages as JSON can keep them: role, text content, a reasoning message's fold."""
    out = []
    for m in messages:
        entry = {"role": m.get("role"), "content": message_text(m.get("content"))}
        metadata = m.get("metadata")
        if isinstance(metadata, dict) and metadata.get("title") == THINKING:
            entry["metadata"] = {"title": THINKING, "status": "done"}
        out.append(entry)
    return out


def imported(path: str | Path) -> tuple[list[dict], str]:
    """The messages and system prompt of an exported chat file (NotAChat if it is not
    one)."""
    path = Path(path)
    if path.stat().st_size > MAX_IMPORT_BYTES:
        raise NotAChat(f"the file is over {MAX_IMPORT_BYTES >> 20} MiB; an exported chat "
                           "is far smaller")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise NotAChat(f"the file is not JSON text ({err})") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not messages:
        raise NotAChat("the file has no \"messages\" list: import a chat saved with "
                           "Export JSON")
    chat = []
    for n, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str)):
            raise NotAChat(f"messages[{n}] must be {{\"role\": \"user\" or \"assistant\", "
                               "\"content\": text}")
        entry = {"role": m["role"], "content": m["content"]}
        if m.get("thinking") is True and m["role"] == "assistant":
            entry["metadata"] = {"title": THINKING, "status": "done"}
        chat.append(entry)
    system = data.get("system") if isinstance(data.get("system"), str) else ""
    return chat, system


def new_id() -> str:
    return str(uuid.uuid4())


class KeptChats:
    """The page's handlers for the kept chats (page.py wires them)."""

    def __init__(self, sessions):
        self.sessions = sessions

    @staticmethod
    def listed(store, current=None):
        return gr.update(choices=choices(store), value=current)

    def restore(self, store):
        """A page load: the chat last open comes back (a new one where there is none)."""
        store = normalized(store)
        chat = find(store, store["current"])
        if chat is None:
            return [], new_id(), store, self.listed(store)
        return chat["messages"], chat["id"], store, self.listed(store, chat["id"])

    def remember(self, history, conversation_id, store):
        store = saved(store, conversation_id, list(history or []))
        return store, self.listed(store, conversation_id if history else None)

    def new_chat(self, store, request: gr.Request):
        self.sessions.cancel(request.session_hash)  # a reply still streaming stops here
        store = normalized(store)
        return [], new_id(), {**store, "current": None}, self.listed(store), ""

    def pick(self, chat_id, conversation_id, store, request: gr.Request):
        chat = find(store, chat_id)
        if chat is None or chat_id == conversation_id:
            return gr.update(), gr.update(), gr.update(), gr.update()
        self.sessions.cancel(request.session_hash)
        return chat["messages"], chat_id, {**normalized(store), "current": chat_id}, \
            f"Opened “{chat['title']}”."

    def import_chat(self, file, store, request: gr.Request):
        try:
            messages, system_prompt = imported(file)
        except (NotAChat, OSError) as err:
            return (gr.update(), gr.update(), store, gr.update(), gr.update(),
                    f"⚠️ Not imported: {err}")
        self.sessions.cancel(request.session_hash)
        chat_id = new_id()
        store = saved(store, chat_id, messages)
        return (messages, chat_id, store, self.listed(store, chat_id),
                system_prompt or gr.update(), f"Imported {len(messages)} messages.")

