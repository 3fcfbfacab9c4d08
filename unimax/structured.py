"""Structured output: a reply held to JSON, or to a JSON schema (the OpenAI API's
``response_format``), to a regex, a choice of strings or an EBNF grammar (vLLM's
``structured_outputs``), or to a tool call in the model's own call format (``tool_choice``
"required" or a named function), by xgrammar's grammar matcher.

Before each token the matcher says which tokens keep the text a prefix of some text the grammar
accepts; the others' logits go to -inf, so greedy decoding takes the model's most likely
token among those allowed (and sampling draws from the model's distribution over them). Once the
text is complete, only the stop tokens are allowed: the reply ends there.

A grammar is compiled once per request on the caller's thread (xgrammar caches compiled
schemas), against the tokenizer's vocabulary padded to the model's: ids the tokenizer lacks are
never allowed. The mask needs each token's logits before the token is chosen, so a constrained
reply runs one token at a time through captured graphs of the mode's engine, the mask applied
inside them (unimax.token_mask, ``Constraint.fill``; verified mode: drafts under the grammar,
each block checked against its masks, ``Constraint.rollback`` taking back the drafts not
kept); with
log-probabilities asked as well, on the exact model's eager per-token path (logprobs.generate,
``Constraint.masked``).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

from .errors import RequestError
from .token_mask import ALL

# The longest run of blanks the grammar allows between tokens of the JSON (xgrammar's
# max_whitespace_cnt; within strings it does not apply). A model held to a grammar whose likely
# next text is forbidden can take blanks forever, the run of a reply to max_tokens (the demo
# model did, after a call's last parameter); a bound ends that. A JSON reply's is wide enough
# for an indented object five levels deep; a call's arguments are written with a line break.
MAX_BLANKS_JSON = 24
MAX_BLANKS_CALL = 4
# Compile time grows about quadratically with a schema's size (an 80 kB schema of 2000 enum
# properties: 0.8 s on one core; 3.5 MB: minutes), so a grammar's text is bounded, and so is
# the time any one compile may take: past either the request is refused (400), and no request
# waits behind another's compile for longer than that.
MAX_GRAMMAR_CHARS = 128 << 10
COMPILE_SECONDS = 10.0
MAX_COMPILING = 2  # compiles running at once (one past its time goes on, holding its slot)


@dataclass(frozen=True)
class ResponseFormat:
    """``json_object``: any JSON object; ``json_schema``: one valid against ``spec`` (the
    schema's JSON text); ``regex``: text matching the pattern ``spec``; ``choice``: one of the
    strings in ``spec`` (a JSON list); ``grammar``: text of the EBNF grammar ``spec``."""

    kind: str
    spec: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolCallFormat:
    """A reply that must call a tool, written in the model's call format: ``grammar`` is
    xgrammar's structural tag for it (tool_calls.call_grammar), ``tools`` OpenAI's list as JSON
    text, ``name`` the function to call (None: any of them, "required"); ``parallel`` False
    stops after the first call."""

    grammar: str
    tools: str
    name: str | None = None
    parallel: bool = True
    kind: str = "tool_call"


def response_format(raw) -> ResponseFormat | None:
    """OpenAI's ``response_format`` ({"type": "text" | "json_object" | "json_schema", ...}) ->
    a ResponseFormat, or None for plain text."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise RequestError("response_format must be {\"type\": \"text\"}, {\"type\": "
                           "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                           "{\"name\": ..., \"schema\": {...}}}")
    spec = raw.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format json_schema needs \"json_schema\": {\"name\": ..., "
                           "\"schema\": {...}}, the schema a JSON object")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError("response_format json_schema.name must be a string")
    return ResponseFormat("json_schema", json.dumps(spec["schema"]), name)


# vLLM's structured_outputs keys that UNI MAX serves (one per request)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def structured_outputs(raw) -> ResponseFormat | None:
    """vLLM's ``structured_outputs`` ({"json": schema} | {"regex": pattern} | {"choice":
    [strings]} | {"grammar": EBNF}) -> a ResponseFormat, or None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError("structured_outputs must be an object with one of "
                           f"{', '.join(STRUCTURED_KINDS)}")
    given = {key: value for key, value in raw.items() if value is not None}
    other = sorted(set(given) - set(STRUCTURED_KINDS))
    if other:
        raise RequestError(f"structured_outputs.{other[0]} is not supported by UNI MAX; it "
                           f"serves {', '.join(STRUCTURED_KINDS)}")
    if len(given) != 1:
        raise RequestError("structured_outputs takes exactly one of "
                           f"{', '.join(STRUCTURED_KINDS)}")
    (kind, value), = given.items()
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = None
        if not isinstance(value, dict):
            raise RequestError("structured_outputs.json must be a JSON schema (an object, or "
                               "its JSON text)")
        return ResponseFormat("json_schema", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise RequestError("structured_outputs.choice must be a non-empty list of "
                               "non-empty strings")
        return ResponseFormat("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"structured_outputs.{kind} must be a non-empty string")
    return ResponseFormat(kind, value)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured output (response_format, structured_outputs, a "
                           "tool_choice that forces a call) needs the xgrammar package, which "
                           "is not installed here: pip install xgrammar (see requirements.txt)"
                           ) from None
    return xgrammar


class Grammars:
    """Compiles response formats for one tokenizer; built on first use (xgrammar reads the
    whole vocabulary once). Safe to call from several threads (xgrammar's compiler is)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, max_chars: int = MAX_GRAMMAR_CHARS,
                 max_seconds: float = COMPILE_SECONDS):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self.max_chars, self.max_seconds = max_chars, max_seconds
        self.compiler = None
        self._init_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_COMPILING)

    def compile(self, fmt: ResponseFormat | ToolCallFormat):
        """The compiled grammar; RequestError for one that is too large, does not compile, or
        takes over ``max_seconds`` (its compile then ends on its own thread, unwaited)."""
        what = "the tools' schemas" if isinstance(fmt, ToolCallFormat) else \
            f"the {fmt.kind.replace('_', ' ')}"
        size = len(fmt.tools if isinstance(fmt, ToolCallFormat) else fmt.spec or "")
        if size > self.max_chars:
            raise RequestError(f"{what} is {size} characters, over the {self.max_chars} that "
                               "structured output compiles; make it smaller")
        xgr = _xgrammar()
        with self._init_lock:
            if self.compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
                self.compiler = xgr.GrammarCompiler(info)
        if not self._slots.acquire(timeout=self.max_seconds):
            raise RequestError("structured output is busy compiling other requests' grammars "
                               "that take long; try again in a while")
        result, done = {}, threading.Event()

        def run() -> None:
            try:
                result["grammar"] = self._compile(xgr, fmt)
            except Exception as err:  # handed to the waiting request below
                result["error"] = err
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="unimax-grammar", daemon=True).start()
        if not done.wait(self.max_seconds):
            raise RequestError(f"{what} took over {self.max_seconds:g} s to compile; make it "
                               "simpler (fewer properties, enum values or alternatives)")
        if "error" in result:
            raise result["error"]
        return result["grammar"]

    def _compile(self, xgr, fmt: ResponseFormat | ToolCallFormat):
        if isinstance(fmt, ToolCallFormat):
            return self._tool_call(xgr, fmt)
        try:
            if fmt.kind == "regex":
                return self.compiler.compile_regex(fmt.spec)
            if fmt.kind == "grammar":
                return self.compiler.compile_grammar(fmt.spec)
            if fmt.kind == "choice":  # an EBNF of the strings, as JSON spells them
                return self.compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in json.loads(fmt.spec)))
            schema = '{"type": "object"}' if fmt.kind == "json_object" else fmt.spec
            return self.compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_BLANKS_JSON)
        except (RuntimeError, ValueError) as err:
            what = {"regex": "the regex", "grammar": "the grammar", "choice": "the choices"}.get(
                fmt.kind, "the JSON schema" + (f" {fmt.name!r}" if fmt.name else ""))
            raise RequestError(f"{what} cannot be used: {_why(err)}") from None

    def _tool_call(self, xgr, fmt: ToolCallFormat):
        choice = "required" if fmt.name is None else \
            {"type": "function", "function": {"name": fmt.name}}
        try:
            # the thinking block, where the prompt opens one, is left to Constraint.active
            tag = xgr.get_model_structural_tag(fmt.grammar, tools=json.loads(fmt.tools),
                                               tool_choice=choice, reasoning="disabled",
                                               parallel_tool_calls=fmt.parallel,
                                               max_whitespace_cnt=MAX_BLANKS_CALL)
            return self.compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError) as err:
            raise RequestError(f"tool_choice: the tools' parameter schemas cannot be used to "
                               f"force a call: {_why(err)}") from None


def _why(err: Exception) -> str:
    """xgrammar's message without the C++ source's time and place it starts with."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err)).strip()


class Constraint:
    """One reply's grammar state, for the engines (``fill``: the mask their graphs apply) and
    for ``logprobs.generate`` (``masked``). ``active`` False: tokens pass unmasked and unfed
    to the grammar (a thinking block before the constrained answer); ``opens`` (a
    reasoning.ThinkingEnd) sees each of them and turns the grammar on after the token that
    ends the block."""

    def __init__(self, compiled, vocab_size: int, active: bool = True, opens=None):
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.active = active
        self.opens = opens

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` (V,) with every token the grammar forbids at -inf."""
        if not self.active:
            return logits
        xgr = _xgrammar()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        out = logits.float().clone()[None]
        # xgrammar's own kernel on a CPU; on a GPU its plain torch form, which needs no
        # compiler for the card (the mask is one small copy per token on this eager path)
        xgr.apply_token_bitmask_inplace(
            out, self.bitmask.to(out.device), vocab_size=self.vocab_size,
            backend="cpu" if out.device.type == "cpu" else "torch_native")
        return out[0]

    def fill(self, out: torch.Tensor) -> None:
        """The next token's bitmask into ``out`` (int32 (1, words), on the CPU; xgrammar's
        layout): the grammar's, or every token while not ``active``. For the engines' graphs
        (unimax.token_mask)."""
        if self.active:
            self.matcher.fill_next_token_bitmask(out)
        else:
            out.fill_(ALL)

    def rollback(self, count: int) -> None:
        """Take back the last ``count`` tokens fed to the grammar (drafts the exact model did
        not keep)."""
        if count and self.active:
            self.matcher.rollback(count)

    def accept(self, token: int) -> None:
        """Feed a chosen token: to the grammar, or (not ``active``) to ``opens``."""
        if not self.active:
            self.active = self.opens is not None and bool(self.opens(token))
        elif not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
