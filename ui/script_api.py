"""The page's stable script endpoints, /chat and /stats (gradio_client, curl). Gradio builds
their API documentation from these functions' annotations, read as objects: this module must
not use ``from __future__ import annotations`` (string annotations show as "Any"). /chat is a
generator, annotated with what it yields (str): Gradio documents a streamed endpoint by the type
of each update."""

import uuid
from typing import Literal

import gradio as gr

from unimax.modes import MODES
from unimax.service import EngineService

from .sessions import Sessions, stream

Mode = Literal[tuple(MODES)]  # the API page lists the modes (bf16, fp8, verified)


def add_script_api(service: EngineService, sessions: Sessions) -> None:
    """Register /chat and /stats on the Blocks being built."""

    def chat(message: str, mode: Mode, request: gr.Request) -> str:
        """Stream the assistant's reply to a one-turn conversation (each update is the reply
        so far). mode: bf16, fp8 or verified."""
        if mode not in MODES:
            raise gr.Error(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if not isinstance(message, str) or not message.strip():
            raise gr.Error("empty message: send some text")
        conversation = f"api-{uuid.uuid4()}"
        text = ""
        try:
            for kind, delta, _ in stream(service, sessions, request.session_hash, conversation,
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
        """This client's latest reply's stats: mode, bridge_mib, bridge_ms, acceptance_rate,
        mean_draft_length, decode_tok_s, prefill_tok_s, ttft_ms, prefilled_tokens, ..."""
        mine = sessions.get_stats(request.session_hash)  # nobody else's, no ids
        mine.pop("conversation_id", None)
        return mine or {"mode": None}

    gr.api(chat, api_name="chat", concurrency_limit=None)
    gr.api(stats, api_name="stats", queue=False)
