"""What may reach the local server at all, checked before any route runs (an ASGI middleware
around the whole app, the page included).

A server on 127.0.0.1 is reachable from every web page the user opens: a page cannot read a
cross-origin reply, but it can send a "simple" request (a ``text/plain`` POST needs no
preflight), and through DNS rebinding a hostile name can point at 127.0.0.1 and read replies
as if it were same-origin. So, as Jupyter and Ollama do:

- the ``Host`` header must name this server (loopback names, the ``--host`` address, and
  ``--allowed-hosts``): a rebound name is refused;
- a request that carries an ``Origin`` must come from the page this server serves, or from an
  origin in ``--cors-origins`` (which then gets CORS headers); any other is refused, page
  uploads and API calls alike;
- the API (``/v1``) takes request bodies of ``application/json`` only (a form or ``text/plain``
  body is what a page can send without a preflight), up to ``max_body`` bytes;
- with API keys (``--api-key``, ``UNIMAX_API_KEY``), ``/v1`` and ``/metrics`` need
  ``Authorization: Bearer <key>``; the page asks for a key at its login (ui/page).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
DEFAULT_MAX_BODY = 8 << 20  # bytes of an API request body (a 256k-token prompt fits)
# the routes a key guards besides the page; /health stays open for liveness checks
GUARDED = ("/v1", "/metrics")
API = "/v1"
KEY_SCOPE = "unimax.key"


@dataclass(frozen=True)
class Access:
    """Who may use the server: ``hosts`` the Host names served ("*": any), ``origins`` the
    foreign origins allowed ("*": any), ``keys`` the API keys (empty: none asked)."""

    hosts: tuple[str, ...] = LOOPBACK
    origins: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    max_body: int = DEFAULT_MAX_BODY
    key_ids: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def make(cls, host: str = "127.0.0.1", allowed_hosts=(), cors_origins=(), keys=(),
             max_body: int = DEFAULT_MAX_BODY) -> Access:
        hosts = {*LOOPBACK, *(h.strip().lower().strip("[]") for h in allowed_hosts if h)}
        if host not in WILDCARDS:
            hosts.add(host.lower().strip("[]"))
        keys = tuple(k for k in keys if k)
        return cls(tuple(sorted(hosts)), tuple(o.rstrip("/") for o in cors_origins if o),
                   keys, max_body, {k: f"key{n}" for n, k in enumerate(keys, 1)})

    def host_ok(self, host_header: str) -> bool:
        if "*" in self.hosts:
            return True
        name = urlsplit(f"//{host_header}").hostname  # drops the port, unwraps [::1]
        return name is not None and name.lower() in self.hosts

    def key_of(self, authorization: str) -> str | None:
        """The key a ``Bearer`` header carries, if it is one of ours (compared in constant
        time); None otherwise."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        token = token.strip()
        for key in self.keys:
            if hmac.compare_digest(token.encode(), key.encode()):
                return key
        return None



def key_id(scope: dict) -> str:
    """The name of the key a request came with ("key1", ...; "" without keys): each key's
    requests keep their states in a pool of their own."""
    return scope.get(KEY_SCOPE, "")


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _json_error(status: int, message: str, code: str, extra_headers=()) -> tuple:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *extra_headers]
    return status, headers, body


class Guard:
    """The ASGI middleware that enforces an ``Access``."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        access, path = self.access, scope.get("path", "")
        websocket = scope["type"] == "websocket"

        async def refuse(status, headers, body, extra=()):
            await _send(send, status, headers, body, extra, websocket)

        host = _header(scope, b"host") or ""
        if not access.host_ok(host):
            return await refuse(*_json_error(
                403, f"this server does not answer to the host name {host!r}; if you reached "
                "it by that name on purpose, start it with --allowed-hosts NAME", "host_refused"))
        origin = _header(scope, b"origin")
        cors = []
        if origin is not None and not self._same_origin(origin, host):
            if "*" not in access.origins and origin.rstrip("/") not in access.origins:
                return await refuse(*_json_error(
                    403, f"cross-origin requests from {origin} are refused; to let that page "
                    f"use this server, start it with --cors-origins {origin}", "origin_refused"))
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin")]
            if not websocket and scope["method"] == "OPTIONS":  # a preflight
                return await _send(send, 204, [*cors, (
                    b"access-control-allow-methods", b"GET, POST, OPTIONS"), (
                    b"access-control-allow-headers", b"authorization, content-type"), (
                    b"access-control-max-age", b"600")], b"")
        if access.keys and path.startswith(GUARDED):
            key = access.key_of(_header(scope, b"authorization") or "")
            if key is None:
                return await refuse(*_json_error(
                    401, "this server needs an API key: send Authorization: Bearer <key> (the "
                    "openai client's api_key)", "invalid_api_key",
                    [(b"www-authenticate", b"Bearer"), *cors]))
            scope[KEY_SCOPE] = access.key_ids[key]
        if not websocket and path.startswith(API) and \
                scope["method"] in ("POST", "PUT", "PATCH"):
            problem = self._body_problem(scope)
            if problem is not None:
                return await _send(send, *problem, cors)
            receive = await self._bounded(receive, send, cors)
            if receive is None:
                return
        if cors:
            send = _with_headers(send, cors)
        return await self.app(scope, receive, send)

    @staticmethod
    def _same_origin(origin: str, host: str) -> bool:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    def _body_problem(self, scope: dict):
        kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if kind != "application/json":
            return _json_error(415, f"the API takes request bodies of Content-Type "
                               f"application/json, not {kind or 'none'}",
                               "unsupported_media_type")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.access.max_body:
            return self._too_large()
        return None

    def _too_large(self):
        return _json_error(413, f"the request body is over this server's limit of "
                           f"{self.access.max_body} bytes (--max-body-mb)", "body_too_large")

    async def _bounded(self, receive, send, cors):
        """The body read up to the limit, then handed on; None when it was over (413 sent)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None
                break
            size += len(message.get("body", b""))
            if size > self.access.max_body:
                status, headers, body = self._too_large()
                await _send(send, status, headers, body, cors)
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if chunks is None:  # the client went away: let the route see it
            return receive
        whole, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        return replay


def _with_headers(send, extra):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


async def _send(send, status: int, headers, body: bytes, extra=(), websocket=False):
    if websocket:  # closed before it is accepted: the client sees a 403
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, *extra]})
    await send({"type": "http.response.body", "body": body})
