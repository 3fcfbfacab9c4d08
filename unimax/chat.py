"""Chat formatting: a conversation -> prompt token ids, and a chat model's stop ids.

Message text is plain text. Only the template's own markers are control tokens: a message that
contains the string "<|im_start|>" gets the characters, not the token, so a user cannot open a
system turn of their own (the template's text is tokenized with special tokens, the messages'
text with ``split_special_tokens``).
"""

from __future__ import annotations

import json

from jinja2 import TemplateError

from .errors import RequestError

ROLES = ("system", "user", "assistant", "tool")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


def check_messages(messages: list[dict], max_chars: int, extra_chars: int = 0) -> None:
    """Roles, text and size of a conversation that ends with a user message (or with the
    results of the tools its last reply called); RequestError otherwise. Runs before any
    tokenizing, so an oversized message costs nothing. ``extra_chars``: the size of what the
    template adds from elsewhere (the tools' definitions)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("the conversation is empty: send at least one user message")
    total = extra_chars
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"message {index} is not a mapping with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError(f"message {index} has the role {role!r}; allowed: "
                               f"{', '.join(ROLES)}")
        if role == "system" and index != 0:
            raise RequestError(f"message {index} is a system message; only the first message "
                               "of a conversation may be one")
        if not isinstance(content, str):
            raise RequestError(f"message {index} has no text content (got "
                               f"{type(content).__name__}); send a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"message {index} is not valid Unicode (a lone surrogate at "
                               f"character {err.start}); send UTF-8 text") from None
        total += len(content)
        if "tool_calls" in message:
            if role != "assistant":
                raise RequestError(f"message {index} has tool_calls, which only an assistant "
                                   "message may have")
            total += _check_tool_calls(message["tool_calls"], index)
    if messages[-1]["role"] not in ("user", "tool"):
        raise RequestError("the conversation must end with a user message (or with tool "
                           "results)")
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise RequestError("empty message: type something to send")
    if total > max_chars:
        raise RequestError(f"the conversation is {total} characters, more than this model's "
                           f"context can hold (at most {max_chars}); shorten it or start a new "
                           "one")


def _check_tool_calls(calls, index: int) -> int:
    """An assistant message's calls, as chat templates read them: a list of ``{"function":
    {"name": str, "arguments": mapping}}``. Returns their size in characters."""
    if not isinstance(calls, list):
        raise RequestError(f"message {index}: tool_calls must be a list")
    size = 0
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), dict):
            raise RequestError(f"message {index}: tool_calls[{number}] must have a function "
                               "with a name and its arguments as an object")
        size += len(function["name"]) + len(json.dumps(function["arguments"]))
    return size


def check_text(text: str, max_chars: int) -> None:
    """A raw prompt (the completions API): a non-empty string of valid Unicode, not too long."""
    if not isinstance(text, str) or not text:
        raise RequestError("the prompt is empty: send some text to continue")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"the prompt is not valid Unicode (a lone surrogate at character "
                           f"{err.start}); send UTF-8 text") from None
    if len(text) > max_chars:
        raise RequestError(f"the prompt is {len(text)} characters, more than this model's "
                           f"context can hold (at most {max_chars})")


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of a raw prompt to continue: the tokenizer's own leading ids (a BOS) and the text as
    plain text."""
    prefix, _ = _added_special_ids(tokenizer)
    body = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    return prefix + [int(i) for i in body]  # no trailing ids: an EOS would end the text


def special_strings(tokenizer) -> list[str]:
    """Every string the tokenizer would turn into a control token."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token))
    return sorted(s for s in found if s)


def encode_chat(tokenizer, messages: list[dict], thinking: bool | None = None,
                tools: list[dict] | None = None, generation_prompt: bool = True) -> list[int]:
    """Prompt ids for a conversation ending with a user message (checked by check_messages),
    with the generation prompt; ``tools`` (OpenAI's function list) go to the chat template.
    Without a chat template: a plain transcript to continue."""
    if getattr(tokenizer, "chat_template", None):
        extra = {} if thinking is None else {"enable_thinking": bool(thinking)}
        extra["add_generation_prompt"] = generation_prompt
        specials = special_strings(tokenizer)
        if tools:
            extra["tools"] = tools
        # tool definitions and call arguments are rendered by the template, not spanned as
        # plain text below: control-token text in them is refused
        calls = [c for m in messages for c in m.get("tool_calls") or ()]
        rendered = json.dumps([tools or [], calls], ensure_ascii=False)
        if any(s in rendered for s in specials):
            raise RequestError("the tools or tool calls contain control-token text (such as "
                               "<|im_start|>); remove it")
        try:
            if not any(s in m["content"] for m in messages for s in specials):
                ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                    **extra)
                return [int(i) for i in ids]
            text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
        except TemplateError as err:  # the template's own raise_exception, or a bad template
            raise RequestError(f"the model's chat template refused this conversation: {err}"
                               ) from None
        return _encode_plain_spans(tokenizer, text, [m["content"] for m in messages])
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    prefix, suffix = _added_special_ids(tokenizer)  # e.g. a Llama tokenizer's BOS
    body = _encode_plain_spans(tokenizer, text + "Assistant:", [m["content"] for m in messages])
    return prefix + body + suffix


def history_end(tokenizer, messages: list[dict], prompt: list[int],
                thinking: bool | None = None, tools: list[dict] | None = None) -> int | None:
    """Where a chat's prompt stops being a prefix of the next turn (the same conversation with
    the reply and a user message after it) as the template renders it; None when it stays one.
    Qwen3.5's template ends the prompt with a thinking block (``<think>`` open, or closed and
    empty) that it leaves out of replies before the last user message, so the state after
    prompt + reply never starts the next turn; the state at this point does. (The reply alone
    would not show it: a reply after the last user message keeps its block.) One token is given
    back, in case the reply's first characters merge with the text before them."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    try:
        later = encode_chat(tokenizer, probe, thinking, tools, generation_prompt=False)
    except Exception:  # a template that refuses the probe: keep the state as before
        return None
    same = next((i for i, (a, b) in enumerate(zip(prompt, later, strict=False)) if a != b),
                min(len(prompt), len(later)))
    return same - 1 if 1 < same < len(prompt) else None


def _encode_plain_spans(tokenizer, text: str, contents: list[str]) -> list[int]:
    """Tokenize ``text``: each of ``contents`` (found in order) as plain text, the rest with
    control tokens. A message the template changed so that it is not found verbatim is refused
    rather than risked."""
    pieces, cursor = [], 0
    for index, content in enumerate(contents):
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            raise RequestError(f"message {index} contains control-token text that the chat "
                               "template rewrites; remove strings such as <|im_start|> from it")
        pieces += [(text[cursor:start], False), (content, True)]
        cursor = start + len(content)
    pieces.append((text[cursor:], False))
    ids: list[int] = []
    for piece, plain in pieces:
        if piece:
            ids += tokenizer(piece, add_special_tokens=False,
                             split_special_tokens=plain).input_ids
    return [int(i) for i in ids]


def _added_special_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text with add_special_tokens=True."""
    bare = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare):])
    return [], []


def stop_ids(tokenizer, eos_token_id, vocab_size: int) -> list[int]:
    """The tokenizer's and the model config's end-of-sequence ids, plus the chat end markers
    the vocabulary has."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    return sorted(i for i in ids if 0 <= i < vocab_size)
