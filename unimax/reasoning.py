"""A reply's reasoning apart from its answer, for chat templates with a thinking block.

Qwen3.5's template with thinking on ends its generation prompt with an open ``<think>\\n``: the
reply starts inside the block, ends it with ``</think>``, and the answer follows. (Other Qwen
templates leave the block to the model, which opens it at the very start of its reply.) The
OpenAI API reports the block's text as ``reasoning_content`` and the page folds it away; the
tokens and their text are untouched, only where each piece is shown differs.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last few tokens' text, special tokens kept) leaves a
    thinking block open, so that the reply starts in reasoning."""
    at = prompt_tail.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt_tail[at:]


class ThinkingEnd:
    """Watches a reply's tokens for the end of its thinking block: called with each token in
    turn, True at the one whose text completes ``</think>`` (a grammar holds the reply from
    the next token: structured.Constraint's ``opens``). The text is the stream's own
    (detokenize.IncrementalDetokenizer, ``previous`` as there)."""

    def __init__(self, tokenizer, previous: int | None = None):
        from .detokenize import IncrementalDetokenizer

        self.text = IncrementalDetokenizer(tokenizer, previous)

    def __call__(self, token: int) -> bool:
        delta = self.text.add([int(token)])
        return bool(delta) and CLOSE in self.text.text[-len(delta) - len(CLOSE):]


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Splits a streamed reply's text into (reasoning, answer) pieces. Text that could still
    be the start of a tag is held back until the next piece (or ``flush``) decides it; a reply
    with no thinking block comes out as its answer unchanged. ``ends``: tags that also end
    the block and start the answer, tag included (Qwen3.5 may open a tool call inside its
    thinking without closing it first)."""

    def __init__(self, opened: bool, ends: tuple[str, ...] = ()):
        self.inside = opened  # within a thinking block
        self.may_open = not opened  # only the reply's very start may open one
        self.after_block = False  # the answer's leading newlines after a block are dropped
        self.held = ""
        self.ends = ends

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        reasoning = answer = ""
        while buf:
            if self.inside:
                found = [(at, tag) for tag in (CLOSE, *self.ends)
                         if (at := buf.find(tag)) >= 0]
                if not found:
                    keep = max(_partial(buf, tag) for tag in (CLOSE, *self.ends))
                    reasoning += buf[:len(buf) - keep]
                    self.held = buf[len(buf) - keep:]
                    break
                at, tag = min(found)
                reasoning += buf[:at]
                closed = tag == CLOSE
                buf = buf[at + len(CLOSE):] if closed else buf[at:]
                self.inside, self.may_open, self.after_block = False, False, closed
            elif self.may_open:
                start = buf.lstrip()
                if start.startswith(OPEN):
                    buf, self.inside, self.may_open = start[len(OPEN):], True, False
                elif OPEN.startswith(start):  # only blanks, or a tag's start, so far
                    self.held = buf
                    break
                else:
                    self.may_open = False
            else:
                if self.after_block:
                    buf = buf.lstrip("\n")
                    if not buf:
                        break
                    self.after_block = False
                answer += buf
                buf = ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The held-back text, at the reply's end: it was not a tag after all."""
        held, self.held = self.held, ""
        if self.inside:
            return held, ""
        return "", held.lstrip("\n") if self.after_block else held
