"""The A/B tab: one prompt through two modes with the same settings and seed, racing side by
side (the engine serves a block of each in turn), then where the texts part and how fast each
side was."""

from __future__ import annotations

import dataclasses
import uuid

import gradio as gr

from unimax.service import EngineService

from .chat_tab import settings_from
from .panels import ab_summary, first_char_difference, highlighted, panel_markdown
from .sessions import Sessions, race


class ABTab:
    def __init__(self, service: EngineService, sessions: Sessions):
        self.service, self.sessions = service, sessions

    def run(self, prompt, mode_a, mode_b, system, temperature, top_p, top_k, max_new, seed,
            thinking, min_p, presence, repetition, request: gr.Request):
        """Yields (status, text A, text B, panel A, panel B)."""
        if not prompt or not prompt.strip():
            yield "⚠️ Empty prompt: type something to compare.", "", "", "", ""
            return
        try:
            settings = settings_from(temperature, top_p, top_k, max_new, seed, thinking, min_p,
                                     presence, repetition)
        except (TypeError, ValueError) as err:
            yield f"⚠️ Bad setting: {err}", "", "", "", ""
            return
        if settings.seed is None:  # both sides must draw the same random numbers
            settings = dataclasses.replace(settings, seed=0)
        texts, stats = {"a": "", "b": ""}, {"a": {}, "b": {}}

        def view(status, start=None):
            return (status, highlighted(texts["a"], start), highlighted(texts["b"], start),
                    panel_markdown(stats["a"]), panel_markdown(stats["b"]))

        messages = ([{"role": "system", "content": system}] if system and system.strip()
                    else []) + [{"role": "user", "content": prompt}]
        sides, modes = ("a", "b"), (mode_a, mode_b)
        conversations = [f"ab-{uuid.uuid4()}" for _ in sides]
        racing = mode_a != mode_b
        status = (f"Racing {mode_a} (A) and {mode_b} (B): the engine runs a block of each in "
                  "turn; each side's tok/s counts its own blocks only…" if racing else
                  f"Both sides are {mode_a}: one engine, so A runs first, then B…")
        errors = {}
        yield view(status)
        for n, kind, text, data in race(self.service, self.sessions, request.session_hash,
                                        [(conversation, messages, mode, settings)
                                         for conversation, mode in zip(conversations, modes,
                                                                       strict=True)]):
            side = sides[n]
            if kind == "delta":
                texts[side] += text
            elif kind == "stats":
                stats[side] = data["stats"]
            elif kind == "error":
                errors[side] = f"⚠️ {modes[n]} ({side.upper()}): {text}"
            else:
                continue
            yield view(" · ".join(errors.values()) or status)
        for conversation in conversations:
            self.service.forget(conversation)
        if errors:
            yield view(" · ".join(errors.values()))
            return
        start = first_char_difference(texts["a"], texts["b"])
        yield view(ab_summary(mode_a, texts["a"], stats["a"], mode_b, texts["b"], stats["b"],
                              settings.temperature), start)
