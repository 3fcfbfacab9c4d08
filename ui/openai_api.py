"""The OpenAI-compatible HTTP API beside the page: ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, ``/health`` and ``/metrics`` (Prometheus), as FastAPI routes on the app's
own server. Requests go through the same EngineService as the page: one engine thread, one
queue, the same kept-state reuse (a client that re-sends a conversation with one more turn
prefills only the new tokens).

Model ids: ``<name>`` (the preset's default mode) and ``<name>:bf16``, ``<name>:fp8``,
``<name>:verified``. Each reply carries the UNI MAX figures in an extra ``unimax`` field (mode,
acceptance_rate, bridge_ms, bridge_mib, decode_tok_s, prefill_tok_s, ttft_ms, prefilled_tokens,
reused_tokens). Sampling defaults are the preset's (greedy in the shipped presets), not
OpenAI's temperature 1. ``tools`` reach the chat template, and the calls the model writes come
back as ``tool_calls`` (unimax/tool_calls.py) for models whose template renders tools.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from unimax import logprobs
from unimax.errors import RequestError
from unimax.logprobs import LogprobsRequest
from unimax.modes import MODES
from unimax.reasoning import ThinkSplitter
from unimax.service import EngineService, RequestHandle
from unimax.settings import GenerationSettings, SettingsError, is_int
from unimax.structured import (
    ResponseFormat,
    ToolCallFormat,
    response_format,
    structured_outputs,
)
from unimax.tool_calls import (
    CALL_TAG,
    Parts,
    ToolCallParser,
    call_format,
    call_grammar,
    check_tools,
)

from .api_metrics import Metrics
from .guard import key_id

# API clients share a pool of kept states per API key (one pool without keys): a conversation
# re-sent with one more turn finds its earlier turns there by token prefix. Each reply says how
# many tokens it reused, so a pool shared by two keys would let one confirm the other's prompts.
API_CONVERSATION = "openai-api"
MAX_STOPS = 4
# JSON nested deeper than this is refused (no request needs it; Python's parser and the chat
# template recurse, and ~1000 levels overflowed them into a 500)
MAX_DEPTH = 64
DISCONNECT_CHECK = 0.2  # seconds between looks for a client that went away
# Fields that change the output and that UNI MAX does not implement: refused, not ignored.
# Each maps to the values that mean "not used".
UNSUPPORTED = {
    # (tools and tool_choice are served: see _tools; response_format: see _response_format)
    "functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}),
    "suffix": (None, ""), "best_of": (None, 1),
    # other servers' sampling extensions that clients send (vLLM, llama.cpp, TGI): ignoring one
    # would answer with output the client did not ask for
    "typical_p": (None, 1, 1.0),
    "top_a": (None, 0, 0.0), "tfs": (None, 1, 1.0), "tfs_z": (None, 1, 1.0),
    "mirostat": (None, 0), "mirostat_mode": (None, 0), "min_tokens": (None, 0),
    "ignore_eos": (None, False), "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False), "stop_token_ids": (None, []),
    # output that is not text, or text shaped by what UNI MAX does not have
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,),
}
# vLLM's older names for its structured_outputs keys (removed in its 0.12; clients still send
# them)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# chat_template_kwargs that reach the template (Qwen's documented way to switch thinking off
# through an OpenAI-compatible server: extra_body={"chat_template_kwargs": {...}})
TEMPLATE_KWARGS = ("enable_thinking",)
# the API's routes under /v1 and their methods (anything else there is answered in the API's
# error shape, naming these)
SERVED = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
SETTING_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "seed": "seed", "min_p": "min_p",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty",
                  "repetition_penalty": "repetition_penalty"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                        code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def model_name(preset_model: str) -> str:
    return Path(preset_model.rstrip("/")).name or preset_model


class StopMatcher:
    """Stop strings on the decoded text: text is released only once no stop can start in it."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.hit = "", 0, False

    def feed(self, delta: str) -> str:
        self.text += delta
        start = max(0, self.sent - self.hold)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.text = self.text[:min(found)]
            return self.flush()
        end = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def add_openai_api(app: FastAPI, service: EngineService) -> None:
    """Mount the API's routes on ``app`` (before Gradio is mounted at /)."""
    preset = service.preset
    name = model_name(preset.model)
    model_ids = {name: preset.mode, **{f"{name}:{m}": m for m in MODES}}
    metrics = Metrics(service)
    created = int(time.time())
    tool_format = call_format(service.tokenizer)  # None: the template takes no tools
    grammar = call_grammar(service.tokenizer)  # None: no forced calls (tool_choice)

    @app.exception_handler(APIError)
    async def api_error(_request, err: APIError):
        return err.response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "device": str(service.device),
                "queue": len(service.pending), "warm_up": service.warm_up_snapshot()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.exception_handler(Exception)
    async def internal_error(_request, err: Exception):
        # a defect, never the client's fault: still in the API's shape, not a bare text 500
        return APIError(500, f"internal error: {type(err).__name__}: {err}",
                        kind="server_error").response()

    def model_entry(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "unimax",
                "unimax_mode": model_ids[model_id]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_entry(model_id) for model_id in model_ids]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not model_id:  # /v1/models/: the list, as before this route
            return await models()
        if model_id not in model_ids:
            raise APIError(404, f"the model {model_id!r} does not exist; this server has "
                           f"{', '.join(model_ids)}", "model", "model_not_found")
        return model_entry(model_id)

    # Requests are parsed, checked, tokenized and their grammars compiled on a worker thread:
    # on the event loop a large request held every other client and the page for its duration.
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        pool = _pool(request)
        prepared = await asyncio.to_thread(lambda: prepare_chat(body, pool))
        return await _respond(request, **prepared, chat=True)

    def prepare_chat(body: dict, pool: str):
        model, mode = _model(body, model_ids)
        messages = _messages(body.get("messages"))
        want = _chat_logprobs(body)
        tools, first_only, forced = _tools(body, tool_format, grammar)
        fmt = forced or _response_format(body, tools)
        settings, stops, stream, usage_chunk = _options(body, service, _thinking(body))
        handle = service.submit(pool, messages, mode, settings, logprobs=want,
                                tools=tools, response_format=fmt)
        parser = ToolCallParser(tool_format, tools, first_only) if tools else None
        return dict(handle=handle, model=model, stops=stops, stream=stream,
                    usage_chunk=usage_chunk, show_logprobs=want is not None, tool_parser=parser)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        pool = _pool(request)
        prepared = await asyncio.to_thread(lambda: prepare_completion(body, pool))
        return await _respond(request, **prepared, chat=False)

    def prepare_completion(body: dict, pool: str):
        model, mode = _model(body, model_ids)
        text, tokens = _prompt(body.get("prompt"))
        if body.get("chat_template_kwargs") is not None:
            raise APIError(400, "chat_template_kwargs applies to /v1/chat/completions: a "
                           "completions prompt goes to the model as it is, with no template",
                           "chat_template_kwargs")
        want, echo = _completion_logprobs(body)
        fmt = _response_format(body)
        if want is not None and not want.generate:  # scoring only: no reply, no max_tokens
            body = {**body, "max_tokens": None, "max_completion_tokens": None}
        settings, stops, stream, usage_chunk = _options(body, service)
        handle = service.submit(pool, [], mode, settings, text=text, tokens=tokens,
                                logprobs=want, response_format=fmt)
        echoed = None
        if echo and want is None:  # (with logprobs the engine thread sends the prompt's text)
            echoed = text if text is not None else service.decode(tokens)
        return dict(handle=handle, model=model, stops=stops, stream=stream,
                    usage_chunk=usage_chunk, echoed=echoed,
                    show_logprobs=body.get("logprobs") is not None)

    # Last, so that the routes above match first. Without it a client calling what is not served
    # here (embeddings, the Responses API, a GET on a POST route) got Starlette's bare
    # {"detail": ...}, which the openai client shows as "Error code: 404" and nothing else.
    # (HEAD and OPTIONS are left to Starlette: a CORS preflight is the middleware's.)
    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                   include_in_schema=False)
    async def not_served(request: Request, path: str):
        route = "/v1/" + path.rstrip("/")
        if SERVED.get(route) == request.method:  # a trailing slash, as Starlette redirects it
            return RedirectResponse(request.url.replace(path=route), status_code=307)
        if route in SERVED:
            raise APIError(405, f"{route} takes {SERVED[route]} requests, not {request.method}",
                           code="method_not_allowed")
        served = ", ".join(f"{method} {url}" for url, method in SERVED.items())
        raise APIError(404, f"UNI MAX does not serve {request.method} /v1/{path}; it serves "
                       f"{served}", code="unknown_url")


# --- request parsing -----------------------------------------------------------------------

def _pool(request: Request) -> str:
    """The kept-state pool of the request's API key (guard.key_id)."""
    key = key_id(request.scope)
    return f"{API_CONVERSATION}:{key}" if key else API_CONVERSATION


async def _json(request: Request) -> dict:
    """The body as a JSON object, parsed on a worker thread (ui/guard.py has bounded its size
    and checked its Content-Type)."""
    return await asyncio.to_thread(_parse, await request.body())


def _parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body is JSON nested too deep; at most {MAX_DEPTH} "
                       "levels are taken") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _depth(body) > MAX_DEPTH:
        raise APIError(400, f"the request body is JSON nested deeper than {MAX_DEPTH} levels; "
                       "no field of this API needs that")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud800" escapes: no text can hold one alone
        bad = ascii(err.object[err.start:err.end])
        raise APIError(400, f"the request holds a lone UTF-16 surrogate ({bad}), which "
                       "is not a character; send the text as valid Unicode") from None
    for field, neutral in UNSUPPORTED.items():
        if field in body and not any(_same(body[field], n) for n in neutral):
            raise APIError(400, f"{field} is not supported by UNI MAX; leave it out", field,
                           "unsupported_parameter")
    n = body.get("n")
    if n is not None and not (is_int(n) and n == 1):
        raise APIError(400, "n must be the integer 1: UNI MAX returns one choice per request",
                       "n", "unsupported_parameter")
    return body


def _depth(value) -> int:
    """How deep JSON nests (an object or list inside another counts one level), walked
    without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((child, level + 1) for child in children)
    return deepest


def _same(value, neutral) -> bool:
    """JSON equality in which true is not 1 (Python's True == 1 is)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _flag(body: dict, param: str) -> bool | None:
    """A JSON true/false field (null: not given); 1 or "yes" is refused, not read as true."""
    value = body.get(param)
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"{param} must be true or false", param)
    return value


def _model(body: dict, model_ids: dict[str, str]) -> tuple[str, str]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required: see GET /v1/models", "model")
    if model not in model_ids:
        raise APIError(404, f"the model {model!r} does not exist; this server has "
                       f"{', '.join(model_ids)}", "model", "model_not_found")
    return model, model_ids[model]


def _prompt(raw) -> tuple[str | None, list[int] | None]:
    """One prompt: a string or a list of token ids, alone or as a list of one (lm-eval sends
    ``[[ids]]``)."""
    def is_ids(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(raw, list) and len(raw) == 1 and (isinstance(raw[0], str) or is_ids(raw[0])):
        raw = raw[0]
    if isinstance(raw, str) and raw:
        return raw, None
    if is_ids(raw):
        return None, raw
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt "
                   "per request)", "prompt")


def _top(value, param: str) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool)
            and 0 <= value <= logprobs.MAX_TOP):
        raise APIError(400, f"{param} must be an integer in 0..{logprobs.MAX_TOP}", param)
    return value


def _chat_logprobs(body: dict) -> LogprobsRequest | None:
    """``logprobs: true`` (and ``top_logprobs``: alternatives per token): the exact model
    serves the request and each token comes with its log-probability."""
    wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
    if not wanted:
        if top is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return LogprobsRequest(top=0 if top is None else _top(top, "top_logprobs"))


def _completion_logprobs(body: dict) -> tuple[LogprobsRequest | None, bool]:
    """The completions API's ``logprobs`` (an integer: alternatives per token) and ``echo``
    (the prompt before the reply; with logprobs, every prompt token's too). ``max_tokens``
    0 with echo scores the prompt alone, as eval harnesses do."""
    top, echo = body.get("logprobs"), bool(_flag(body, "echo"))
    scoring_only = echo and body.get("max_tokens") == 0
    if top is None and not scoring_only:
        return None, echo
    top = 0 if top is None else _top(top, "logprobs")
    return LogprobsRequest(top=top, prompt=echo, generate=not scoring_only), echo


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty list of {role, content}", "messages")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{index}] must be an object", "messages")
        role = "system" if message.get("role") == "developer" else message.get("role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{index}].content: only text parts are "
                               "supported", "messages")
            content = "".join(p["text"] for p in content)
        entry = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            entry["content"] = content or ""  # a reply that only called tools has none
            entry["tool_calls"] = [_call_of(call, index, n)
                                   for n, call in enumerate(message["tool_calls"])]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    entry[key] = message[key]
        messages.append(entry)
    return messages


def _call_of(call, index: int, number: int) -> dict:
    """An assistant message's tool call as OpenAI sends it (arguments as JSON text) -> as chat
    templates read it (arguments as a mapping)."""
    where = f"messages[{index}].tool_calls[{number}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must be {{id, type: function, function: {{name, "
                       "arguments}}}}", "messages")
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object (as text)",
                       "messages")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _tools(body: dict, tool_format: dict | None, grammar: str | None
           ) -> tuple[list[dict] | None, bool, ToolCallFormat | None]:
    """The tools offered to the model, whether only its first call counts
    (``parallel_tool_calls: false``), and the call the reply is held to where ``tool_choice``
    forces one ("required", or ``{"type": "function", "function": {"name": ...}}``: the model's
    call format as a grammar, unimax/structured.py). tool_choice "none" keeps the tools from the
    model."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _flag(body, "parallel_tool_calls")
    name = _forced_name(choice)
    if tools in (None, []) or choice == "none":
        if choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice forces a call, but the request has no tools",
                           "tool_choice")
        return None, False, None
    try:
        check_tools(tools)
    except RequestError as err:
        raise APIError(400, str(err), "tools") from None
    if tool_format is None:
        raise APIError(400, "this model's chat template does not take tools, so the model "
                       "cannot call any; leave tools out, or serve a model whose template "
                       "renders them (Qwen3.5, Qwen3)", "tools", "unsupported_parameter")
    if choice in (None, "auto"):
        return tools, parallel is False, None
    names = [tool["function"]["name"] for tool in tools]
    if name is not None and name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools "
                       f"({', '.join(names)})", "tool_choice")
    if grammar is None:
        raise APIError(400, "tool_choice can force a call only in the call formats UNI MAX "
                       "has a grammar for (Qwen3.5's, Qwen3's); this model's is another: use "
                       "\"auto\"", "tool_choice", "unsupported_parameter")
    forced = ToolCallFormat(grammar, json.dumps(tools), name, parallel is not False)
    return tools, parallel is False, forced


def _forced_name(choice) -> str | None:
    """The function a named tool_choice forces (None for the string choices)."""
    if choice in (None, "auto", "none", "required"):
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                       "tool_choice")
    return function["name"]


def _response_format(body: dict, tools: list[dict] | None = None) -> ResponseFormat | None:
    """The reply held to a grammar (unimax/structured.py), served by the mode's engine one
    masked step at a time: OpenAI's ``response_format`` (JSON, a JSON schema), vLLM's
    ``structured_outputs`` (also a regex, a choice, an EBNF grammar) or its older ``guided_*``
    fields; one of them."""
    formats = {}
    for param in ("response_format", "structured_outputs", *GUIDED):
        if body.get(param) is None:
            continue
        try:
            fmt = response_format(body[param]) if param == "response_format" else \
                structured_outputs(body[param] if param == "structured_outputs" else
                                   {GUIDED[param]: body[param]})
        except RequestError as err:
            raise APIError(400, str(err), param) from None
        if fmt is not None:
            formats[param] = fmt
    if len(formats) > 1:
        raise APIError(400, f"{' and '.join(formats)} both hold the reply to a format; send "
                       "one", list(formats)[1])
    param, fmt = next(iter(formats.items()), (None, None))
    if fmt is not None and tools:
        raise APIError(400, f"{param} with tools: a reply held to the format cannot call a "
                       "tool; send one of them", param, "unsupported_parameter")
    return fmt


def _thinking(body: dict) -> bool | None:
    """The chat template's thinking switch from chat_template_kwargs (None: the preset's)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    for key in kwargs:
        if key not in TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs.{key} is not supported; UNI MAX passes "
                           f"only {', '.join(TEMPLATE_KWARGS)} to the chat template",
                           "chat_template_kwargs", "unsupported_parameter")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true, false or null",
                       "chat_template_kwargs")
    return thinking


def _options(body: dict, service: EngineService, thinking: bool | None = None):
    defaults = service.default_settings()

    def given(key: str, field: str):  # a JSON null means "the default"
        value = body.get(key)
        return getattr(defaults, field) if value is None else value

    newer = "max_completion_tokens"  # OpenAI's newer name for max_tokens
    values = {"max_new_tokens": given(newer if body.get(newer) is not None else "max_tokens",
                                      "max_new_tokens"),
              "temperature": given("temperature", "temperature"),
              "top_p": given("top_p", "top_p"), "top_k": given("top_k", "top_k"),
              "min_p": given("min_p", "min_p"), "seed": given("seed", "seed"),
              # (unimax.penalties: OpenAI's two, and vLLM's repetition_penalty)
              **{name: given(name, name) for name in ("presence_penalty", "frequency_penalty",
                                                     "repetition_penalty")},
              "thinking": defaults.thinking if thinking is None else thinking}
    try:
        settings = GenerationSettings(**values)
    except SettingsError as err:
        raise APIError(400, f"{SETTING_PARAMS.get(err.field, err.field)}: {err}",
                       SETTING_PARAMS.get(err.field, err.field)) from None
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS}",
                       "stop")
    stream = bool(_flag(body, "stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return settings, stops, stream, bool(options.get("include_usage"))


# --- responses -----------------------------------------------------------------------------

async def _events(handle: RequestHandle, request: Request):
    """The request's events, handed to the event loop by the engine thread (no thread waits
    per request: forty waiting requests held the executor's threads and slowed the running
    stream tenfold). A client that goes away cancels it: checked every ``DISCONNECT_CHECK``
    seconds, also while events flow (a non-streaming reply's never paused)."""
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    handle.subscribe(lambda event: loop.call_soon_threadsafe(inbox.put_nowait, event))
    checked = loop.time()
    try:
        while True:
            try:
                event = await asyncio.wait_for(inbox.get(), DISCONNECT_CHECK)
            except TimeoutError:
                event = None
            if loop.time() - checked >= DISCONNECT_CHECK:
                checked = loop.time()
                if await request.is_disconnected():
                    handle.cancel()
                    return
            if event is None:
                continue
            yield event
            if event.kind in ("done", "error"):
                return
    finally:
        if not handle.finished.is_set():
            handle.cancel()


def _failure(handle: RequestHandle) -> APIError | None:
    """A request refused before it ran (bad messages, over the context...)."""
    if handle.outcome is None or handle.outcome[0] != "error":
        return None
    return _error_of(handle.outcome[1])


def _error_of(data: dict) -> APIError:
    reason = data.get("reason")
    if reason == "invalid_request":
        return APIError(400, data["text"])
    if reason == "out_of_memory":
        return APIError(503, data["text"], code="out_of_memory", kind="server_error")
    return APIError(500, data["text"], kind="server_error")


def _unimax_fields(stats: dict) -> dict:
    keys = ("mode", "acceptance_rate", "bridge_ms", "bridge_mib", "decode_tok_s",
            "prefill_tok_s", "ttft_ms", "prefilled_tokens", "reused_tokens", "drafted_tokens",
            "accepted_draft_tokens")
    return {k: stats.get(k) for k in keys}


def _finish_reason(stopped: str | None, matcher: StopMatcher, called: bool = False) -> str:
    if called:
        return "tool_calls"
    return "length" if stopped == "length" and not matcher.hit else "stop"


def _tool_calls_of(calls: list[dict], first: int = 0, stream: bool = False) -> list[dict]:
    """Parsed calls in OpenAI's shape; ``first``: the reply's count of calls before these."""
    return [{**({"index": first + n} if stream else {}),
             "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for n, c in enumerate(calls)]


def _chat_logprobs_of(items: list[dict]) -> dict:
    def one(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(i["text"], i["logprob"]),
                         "top_logprobs": [one(t, lp) for t, lp in i["top"]]} for i in items],
            "refusal": None}


def _completion_logprobs_of(items: list[dict], shift: int) -> dict:
    return {"tokens": [i["text"] for i in items],
            "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [None if i["logprob"] is None else dict(i["top"]) for i in items],
            "text_offset": [i["offset"] + shift for i in items]}


async def _respond(request, handle, model, stops, stream, usage_chunk, chat: bool,
                   echoed: str | None = None, show_logprobs: bool = False,
                   tool_parser: ToolCallParser | None = None):
    failure = _failure(handle)
    if failure is not None:
        raise failure
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    base = {"id": ident, "created": int(time.time()), "model": model}
    matcher = StopMatcher(stops)
    # a chat reply's thinking block goes out as reasoning_content (after the stop strings,
    # which see the whole text, as the model wrote it)
    splitter = ThinkSplitter(handle.thinking_open,
                             ends=(CALL_TAG,) if tool_parser else ()) if chat else None
    usage = {"prompt_tokens": len(handle.prompt)}
    # Reply entries wait here until the text they start in is released past the stop matcher;
    # entries past a stop string are dropped with its text. "shift": the echoed prompt's
    # length, which the reply's text offsets count from.
    state = {"stats": {}, "stopped": None, "error": None, "pending": [], "shift": 0,
             "calls": 0}

    def logprobs_of(items: list[dict], shift: int) -> dict | None:
        if not show_logprobs:
            return None
        return _chat_logprobs_of(items) if chat else _completion_logprobs_of(items, shift)

    def release(upto: int | None) -> list[dict]:
        pending = state["pending"]
        count = len(pending) if upto is None else \
            next((n for n, i in enumerate(pending) if i["offset"] >= upto), len(pending))
        out, state["pending"] = pending[:count], pending[count:]
        return out

    def choice(text: str, finish: str | None, items=(), shift: int = 0,
               first: bool = False, parts: Parts | None = None) -> dict:
        logprobs = logprobs_of(list(items), shift) if items else None
        if not chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        delta = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        if parts is not None and parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts is not None and parts.calls:
            delta["tool_calls"] = _tool_calls_of(parts.calls, state["calls"], stream=True)
            state["calls"] += len(parts.calls)
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def split(piece: str, last: bool = False) -> Parts:
        """What a piece of the reply is: reasoning, answer text, tool calls; ``last``: also
        what was held back."""
        parts = Parts(content=piece)
        if splitter is not None:
            reasoning, answer = splitter.feed(piece)
            if last:
                more = splitter.flush()
                reasoning, answer = reasoning + more[0], answer + more[1]
            parts = Parts(reasoning=reasoning, content=answer)
        if tool_parser is not None:
            answer = tool_parser.feed(parts.content)
            if last:
                answer += tool_parser.finish()
            parts = Parts(parts.reasoning + answer.reasoning, answer.content, answer.calls)
            if tool_parser.done:  # parallel_tool_calls false: the first call ends the reply
                handle.cancel("stop")
        return parts

    async def consume():
        """Yields the output's pieces as (text, entries, offset shift): the echoed prompt
        first, then the reply; ``state`` gets the reply's stats, how it stopped, or its error.
        After a stop string the request is cancelled and the rest dropped."""
        if echoed is not None:
            state["shift"] = len(echoed)
            yield echoed, [], 0
        async for event in _events(handle, request):
            if event.kind == "prompt":  # echo with logprobs: the prompt as the model read it
                state["shift"] = len(event.text)
                yield event.text, event.data["logprobs"], 0
            elif event.kind == "delta" and not matcher.hit:
                state["pending"] += event.data.get("logprobs", [])
                piece = matcher.feed(event.text)
                if matcher.hit:
                    handle.cancel("stop")  # the engine ends within one block; stats come
                yield piece, release(matcher.sent), state["shift"]
            elif event.kind == "done":
                state["stats"] = event.data.get("stats") or {}
                state["stopped"] = event.data.get("stopped")
            elif event.kind == "error":
                state["error"] = _error_of({"text": event.text, **event.data})
        piece = matcher.flush()
        yield piece, release(len(matcher.text) if matcher.hit else None), state["shift"]

    def usage_of() -> dict:
        completion = int(state["stats"].get("generated_tokens") or 0)
        return {**usage, "completion_tokens": completion,
                "total_tokens": usage["prompt_tokens"] + completion}

    if not stream:
        text, items = "", []
        async for piece, released, shift in consume():
            text += piece
            items += [{**i, "offset": i["offset"] + shift} for i in released]
        if state["error"] is not None:
            raise state["error"]
        finish = _finish_reason(state["stopped"], matcher)
        logprobs = logprobs_of(items, 0)
        if chat:
            parts = split(text, last=True)
            message = {"role": "assistant", "content": parts.content}
            if parts.reasoning:
                message["reasoning_content"] = parts.reasoning
            if parts.calls:  # as OpenAI's: no content beside the calls is null
                message["content"] = parts.content or None
                message["tool_calls"] = _tool_calls_of(parts.calls)
                finish = _finish_reason(state["stopped"], matcher, called=True)
            choices = [{"index": 0, "message": message, "finish_reason": finish,
                        "logprobs": logprobs}]
        else:
            choices = [{"index": 0, "text": text, "finish_reason": finish,
                        "logprobs": logprobs}]
        return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion",
                             "choices": choices, "usage": usage_of(),
                             "unimax": _unimax_fields(state["stats"])})

    kind = "chat.completion.chunk" if chat else "text_completion"

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def chunks():
        if chat:
            yield sse({**base, "object": kind, "choices": [choice("", None, first=True)]})
        async for piece, released, shift in consume():
            parts = split(piece)
            if parts.content or parts.reasoning or parts.calls or (released and show_logprobs):
                yield sse({**base, "object": kind, "choices": [
                    choice(parts.content, None, released, shift, parts=parts)]})
        parts = split("", last=True)
        if parts.content or parts.reasoning or parts.calls:
            yield sse({**base, "object": kind,
                       "choices": [choice(parts.content, None, parts=parts)]})
        if state["error"] is not None:
            yield sse(state["error"].body())
        else:
            finish = _finish_reason(state["stopped"], matcher, called=state["calls"] > 0)
            yield sse({**base, "object": kind, "choices": [choice("", finish)],
                       "unimax": _unimax_fields(state["stats"])})
            if usage_chunk:
                yield sse({**base, "object": kind, "choices": [], "usage": usage_of()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
