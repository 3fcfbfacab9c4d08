"""Tool calls: the tools a chat request offers go to the model's chat template, and the calls the
model writes come apart from its answer.

The chat template teaches the model a call format; the format is read back with
transformers' response parser (``transformers.utils.chat_parsing``) and the response template
that ``transformers serve`` uses for that format:

- Qwen3.5's ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``
  (templates that write ``<function=``);
- Qwen2.5 / Qwen3's (Hermes') ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A tokenizer that ships its own ``response_template`` is parsed with that one. Arguments are cast
to the types the tool's JSON schema declares. The parser holds back text that could still be the
start of a call, so a streamed answer never shows a call's markup; a call the model did not finish
(cut by max_tokens or a stop string) or wrote malformed stays in the answer as the text it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

from .errors import RequestError

# serve's name for each call format (its table is keyed by model type)
FORMATS = {"xml": "qwen3_5", "json": "qwen3"}
# xgrammar's structural tag for each (structured.ToolCallFormat: tool_choice that forces a call)
GRAMMARS = {"xml": "qwen_3_5", "json": "qwen_3"}
# how a call opens in both: Qwen3.5 may write one inside its thinking block without closing
# the block first, so with tools this tag ends the block too (reasoning.ThinkSplitter)
CALL_TAG = "<tool_call>"
# what the parser raises on a call it cannot read (its JSON, its transform into a call): the
# model's output, never a reason to fail the request
PARSE_ERRORS = (ValueError, KeyError, TypeError)


def call_format(tokenizer) -> dict | None:
    """The response template that reads this model's tool calls; None when its chat template
    does not render tools (the model was never shown any) or writes calls in no known format."""
    if not _takes_tools(tokenizer):
        return None
    own = getattr(tokenizer, "response_template", None)
    if isinstance(own, dict) and "tool_calls" in own.get("fields", {}):
        return own
    kind = _kind(tokenizer)
    if kind is None:
        return None
    try:
        from transformers.cli.serving.utils import get_response_template
    except ImportError:  # an older or newer transformers without serve's table
        return None
    config = SimpleNamespace(model_type=FORMATS[kind])
    config.config = config  # serve's lookup reads a config (a model's in transformers 5.15)
    return get_response_template(tokenizer, config)


def call_grammar(tokenizer) -> str | None:
    """xgrammar's structural-tag name for the call format this model's template teaches (what a
    forced call is held to); None where there is none here (no tools, another format, or the
    tokenizer's own response template, which may read calls otherwise)."""
    if not _takes_tools(tokenizer) or getattr(tokenizer, "response_template", None):
        return None
    return GRAMMARS.get(_kind(tokenizer))


def _takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(re.search(r"\btools\b", template))


def _kind(tokenizer) -> str | None:
    template = tokenizer.chat_template
    return "xml" if "<function=" in template else "json" if "<tool_call>" in template else None


def check_tools(tools) -> list[dict]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "description",
    "parameters"}}``; RequestError naming the first bad entry."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of {type: function, function: {...}}")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"{where} must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' "
                               "or '-'")
        if name in names:
            raise RequestError(f"{where}: two tools are named {name!r}")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise RequestError(f"{where}.function.description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"{where}.function.parameters must be a JSON Schema object")
    return tools


@dataclass
class Parts:
    """What a piece of the reply's text turned out to be."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments": JSON text}

    def __iadd__(self, other: Parts) -> Parts:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser:
    """Splits a streamed answer into its text and the tool calls in it. ``feed`` each piece of
    text, ``finish`` at the reply's end; text that could start a call is held back until it is
    decided. ``first_only``: the calls after the first are dropped (OpenAI's
    ``parallel_tool_calls: false``); ``done`` tells when the reply can stop."""

    def __init__(self, response_template: dict, tools: list[dict] | None = None,
                 first_only: bool = False):
        from transformers.utils.chat_parsing import ResponseParser
        from transformers.utils.chat_parsing.response_templates import load_response_template

        self.spec, self.tools = load_response_template(response_template), tools
        calls = self.spec.fields["tool_calls"]
        self.opens, self.closes = calls.open_re, calls.close_re  # a call's ends in the text
        # prefix "": the parser reads the answer alone (the thinking block is split off before)
        self.parser = ResponseParser(self.spec, prefix="", tools=tools)
        self.first_only = first_only
        self.raw = ""  # every character fed
        self.sent = 0  # characters of content given out
        self.in_call = False
        self.broken = False  # a call failed to parse: the rest is plain text
        self.calls = 0

    @property
    def done(self) -> bool:
        return self.first_only and self.calls > 0

    def feed(self, text: str) -> Parts:
        self.raw += text
        if self.broken:
            return Parts(content=text)
        try:
            return self._parts(self.parser.feed(text))
        except PARSE_ERRORS:  # the model wrote a call that does not parse
            return self._break()

    def finish(self) -> Parts:
        if self.broken:
            return Parts()
        try:
            _, events = self.parser.finalize()
        except PARSE_ERRORS:
            return self._break()
        # (the parser closes a call that ends the text only here, and closes an unfinished
        # one here too)
        if self.in_call and not self._call_closed():  # cut short: what was written stays text
            events = [e for e in events if e["type"] != "region_close"]
            parts = self._parts(events)
            parts.content += self._call_text()
            return parts
        parts = self._parts(events)
        if self.calls and not parts.content.strip():  # the blanks after the last call
            parts.content = ""
        return parts

    def _parts(self, events: list[dict]) -> Parts:
        parts = Parts()
        for event in events:
            kind, name = event["type"], event.get("field")
            if name == "tool_calls":
                self.in_call = kind != "region_close"
                if kind == "region_close":
                    self.calls += 1
                    if self.calls == 1 or not self.first_only:
                        function = event["value"]["function"]
                        arguments = function.get("arguments") or {}
                        if not isinstance(arguments, str):
                            arguments = json.dumps(arguments, ensure_ascii=False)
                        parts.calls.append({"name": function["name"],
                                            "arguments": arguments})
            elif kind == "region_chunk" and not (self.done and name == "content"):
                if name == "content":
                    parts.content += event["text"]
                    self.sent += len(event["text"])
                elif name == "reasoning_content":  # a second thinking block in the answer
                    parts.reasoning += event["text"]
        return parts

    def _call_open(self):
        """Where the call being read opens in the raw text (the blanks before its opening
        tag, which the parser held back, included)."""
        return next(reversed(list(self.opens.finditer(self.raw))), None)

    def _call_text(self) -> str:
        opened = self._call_open()
        return self.raw[opened.start():] if opened else ""

    def _call_closed(self) -> bool:
        opened = self._call_open()
        return self.closes is None or opened is None or \
            self.closes.search(self.raw, opened.end()) is not None

    def _break(self) -> Parts:
        """The call that failed to parse, and all after it, is text. The parser's events from
        the piece that failed are lost with its error: the text before the call is read again
        by a fresh parser, and what of it was not given out yet is."""
        from transformers.utils.chat_parsing import ResponseParser

        self.broken = True
        if self.done:
            return Parts()
        call = self._call_text()
        replay = ResponseParser(self.spec, prefix="", tools=self.tools)
        events = replay.feed(self.raw[:len(self.raw) - len(call)]) + replay.finalize()[1]
        before = "".join(e["text"] for e in events
                         if e["type"] == "region_chunk" and e.get("field") == "content")
        return Parts(content=before[self.sent:] + call)
