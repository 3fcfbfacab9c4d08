"""Chat text as the page's Chatbot shows it: Markdown, but no HTML from the text itself and
doctest lines as code. ``shown`` makes the Chatbot's text from a message's, ``raw`` gives it
back exactly (``raw(shown(t)) == t`` for every text: tests/app/test_display.py), so the handlers and
the kept chats hold what was typed and generated, never the display's escapes.

Three rewrites, all outside code (fenced blocks and inline code spans, which Markdown shows
as typed anyway):
- ``<`` before a letter, ``/``, ``!`` or ``?`` (a tag or comment: ``<b>``, ``<img ...>``)
  becomes ``&lt;``, and ``&`` that starts an entity (``&lt;``, ``&#60;``) becomes ``&amp;``,
  so the text shows as typed rather than as HTML;
- a run of doctest lines (``>>> ...`` with its output, to the next blank line), which
  Markdown reads as nested quotes, goes into a ``pycon`` code fence (``ADDED``);
- a fence of the text's own that ``raw`` would read as an added one gets a space more.
"""

from __future__ import annotations

import re

import gradio as gr

ADDED = "```pycon"  # the opening line of a fence shown() added (closed by a bare ```)
_FENCE = re.compile(r"^ {0,3}(`{3,}(?=[^`]*$)|~{3,})")  # (no backtick after a ``` fence's run)
_OWN_PYCON = re.compile(r"^```pycon *$")  # shown() adds one space to these (raw takes it)
_DOCTEST = re.compile(r"^ {0,3}>>>(?: |$)")
_TAG = re.compile(r"<(?=[A-Za-z/!?])")
_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
_UNESCAPE = re.compile(r"&lt;|&amp;(?=#?[A-Za-z0-9]+;)")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)(?<!`)\1(?!`)")


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a fence opened by ``fence`` (the same character, at least as
    many, nothing after but spaces)."""
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) > 3:
        return False
    run = len(stripped) - len(stripped.lstrip(fence[0]))
    return run >= len(fence) and not stripped[run:].strip()


def _prose(line: str, escape) -> str:
    """``escape`` applied to a prose line's text outside its inline code spans."""
    out, at = [], 0
    for span in _CODE_SPAN.finditer(line):
        out += [escape(line[at:span.start()]), span.group()]
        at = span.end()
    return "".join(out + [escape(line[at:])])


def _escape(text: str) -> str:
    return _TAG.sub("&lt;", _ENTITY.sub("&amp;", text))


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda m: "<" if m.group() == "&lt;" else "&", text)


def _code_block(lines: list[str], n: int, fence: str, out: list[str]) -> int:
    """Copy a code block's lines after its opening line (``lines[n - 1]``, ``fence`` its run)
    to its closing fence or the text's end into ``out``; the index after it."""
    while n < len(lines):
        out.append(lines[n])
        n += 1
        if _closes(out[-1], fence):
            break
    return n


def shown(text: str) -> str:
    """A message's text as the Chatbot shows it."""
    lines, out, n = text.split("\n"), [], 0
    while n < len(lines):
        line = lines[n]
        fence = _FENCE.match(line)
        if fence:  # the text's own code block, to its closing fence (or the end)
            out.append(line + " " if _OWN_PYCON.match(line) else line)
            n = _code_block(lines, n + 1, fence.group(1), out)
        elif _DOCTEST.match(line):
            end = n
            while end < len(lines) and lines[end].strip() and not _FENCE.match(lines[end]):
                end += 1
            out += [ADDED, *lines[n:end], "```"]
            n = end
        else:
            out.append(_prose(line, _escape))
            n += 1
    return "\n".join(out)


def raw(text: str) -> str:
    """The message's own text from the Chatbot's (shown's inverse)."""
    lines, out, n = text.split("\n"), [], 0
    while n < len(lines):
        line = lines[n]
        fence = _FENCE.match(line)
        if line == ADDED:  # ours: its lines are the text's, the fences go
            n += 1
            while n < len(lines) and lines[n] != "```":
                out.append(lines[n])
                n += 1
            n += 1
        elif fence:
            out.append(line[:-1] if _OWN_PYCON.match(line) and line.endswith(" ") else line)
            n = _code_block(lines, n + 1, fence.group(1), out)
        else:
            out.append(_prose(line, _unescape))
            n += 1
    return "\n".join(out)


def _map_text(message, fn):
    """A chat message (a dict; Gradio's parts lists too) with ``fn`` applied to its text."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": fn(content)}
    if isinstance(content, list):
        return {**message, "content": [
            {**part, "text": fn(part["text"])} if isinstance(part, dict)
            and isinstance(part.get("text"), str) else part for part in content]}
    return message


class Chatbot(gr.Chatbot):
    """Gradio's Chatbot that shows each message's text through ``shown`` and hands it back
    through ``raw``: the handlers read and write messages as typed and generated. A subclass,
    not methods wrapped on an instance: Gradio rebuilds a component from its class when an
    update changes its settings. (Gradio writes a .pyi of it beside this file: git ignores
    it.)"""

    def get_block_name(self) -> str:
        return "chatbot"  # the frontend's component is Gradio's own

    def postprocess(self, value):
        return super().postprocess(None if value is None else
                                   [_map_text(m, shown) for m in value])

    def preprocess(self, payload):
        return [_map_text(m, raw) for m in super().preprocess(payload)]
