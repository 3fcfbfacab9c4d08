"""Streaming token ids to text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas for a growing token list in O(new tokens) per call: decode a short window that
    starts a few tokens back (so word-boundary spaces and merges come out right) and emit what
    it adds; hold back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into text

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.tokens[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The rest at the end of a reply, an incomplete character included (shown as the
        replacement character, as a full decode would)."""
        decode = self.tokenizer.decode
        before = decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.tokens[self.prefix:], skip_special_tokens=True)
        delta = after[len(before):] if len(after) > len(before) else ""
        self.prefix = self.read = len(self.tokens)
        self.text += delta
        return delta
