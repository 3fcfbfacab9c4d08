"""Streaming token ids to text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas for a growing token list in O(new tokens) per call: decode a short window that
    starts a few tokens back (so word-boundary spaces and merges come out right) and emit what
    it adds; hold back an incomplete UTF-8 character. ``previous``: the token before the first
    one, whose text is not part of this text but whose context is: SentencePiece drops the
    leading space of a text's first word, which a completion of a raw prompt must keep
    ("The os module is" + " not optional."). ``hidden``: ids never shown (the stop ids: a
    tokenizer need not mark every stop token special, and the demo's "</s>" showed as text)."""

    def __init__(self, tokenizer, previous: int | None = None, hidden=()):
        self.tokenizer = tokenizer
        self.hidden = frozenset(hidden)
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into text
        self.context = [] if previous is None else [previous]

    def _decode(self, end: int) -> str:
        head = self.context if self.prefix == 0 else []
        window = [t for t in self.tokens[self.prefix:end] if t not in self.hidden]
        return self.tokenizer.decode(head + window, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        before, after = self._decode(self.read), self._decode(len(self.tokens))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The rest at the end of a reply, an incomplete character included (shown as the
        replacement character, as a full decode would)."""
        before, after = self._decode(self.read), self._decode(len(self.tokens))
        delta = after[len(before):] if len(after) > len(before) else ""
        self.prefix = self.read = len(self.tokens)
        self.text += delta
        return delta
