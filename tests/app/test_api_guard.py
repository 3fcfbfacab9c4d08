"""Who may use the local server (ui/guard.py), tried as a hostile web page and a second local
user would: a rebound Host name, a foreign Origin, a body a page can send without a preflight,
an oversized body, a schema that takes minutes to compile, a missing or another user's API key.
All against the real app over HTTP."""

import json
import threading
import time

import httpx
import openai
import pytest
from app_server import running_app

from app import main as app_main

MODEL = "unimax-demo"
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}


def post(url: str, body=None, content: bytes | None = None, **headers) -> httpx.Response:
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(url + "v1/chat/completions", timeout=120, headers=headers,
                      content=content if content is not None else json.dumps(body).encode())


def enum_schema(properties: int) -> dict:
    return {"type": "object", "properties": {
        f"p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(properties)}}


def test_a_rebound_host_name_is_refused(api_server):
    """DNS rebinding: a hostile name resolved to 127.0.0.1 reaches the server with its own
    Host header; the page and the API refuse it."""
    for path in ("", "v1/models", "health"):
        r = httpx.get(api_server + path, headers={"Host": "attacker.example"}, timeout=30)
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
    for host in ("localhost", "127.0.0.1"):
        port = api_server.rsplit(":", 1)[1].strip("/")
        r = httpx.get(api_server + "v1/models", headers={"Host": f"{host}:{port}"}, timeout=30)
        assert r.status_code == 200


def test_a_foreign_page_cannot_drive_the_api_or_the_page(api_server):
    """A page on another origin: its text/plain POST (no preflight needed) and any request that
    carries its Origin are refused, Gradio's upload route included; the page's own origin
    passes."""
    evil = {"Origin": "http://attacker.example"}
    r = post(api_server, CHAT, **evil)
    assert r.status_code == 403 and "--cors-origins" in r.json()["error"]["message"]
    upload = httpx.post(api_server + "gradio_api/upload", headers=evil, timeout=30,
                        files={"files": ("a.json", b"{}")})
    assert upload.status_code == 403
    r = post(api_server, content=json.dumps(CHAT).encode(), **{"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    own = api_server.rstrip("/")
    assert post(api_server, CHAT, Origin=own).status_code == 200
    assert httpx.post(api_server + "gradio_api/upload", headers={"Origin": own}, timeout=30,
                      files={"files": ("a.json", b"{}")}).status_code == 200


def test_a_body_over_the_limit_is_a_413(api_server):
    r = post(api_server, {**CHAT, "padding": "x" * (9 << 20)})
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * (1 << 20)

    r = httpx.post(api_server + "v1/chat/completions", content=chunked(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert post(api_server, CHAT).status_code == 200


def test_a_large_schema_neither_freezes_the_server_nor_compiles_for_minutes(api_server):
    """8,000 enum properties froze /health for 9 s (compiled on the event loop); now a schema
    over the bound is refused at once, and one under it compiles while others are served."""
    start = time.perf_counter()
    r = post(api_server, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": enum_schema(8000)}}})
    assert r.status_code == 400 and "over the" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - start < 5
    done = {}
    thread = threading.Thread(target=lambda: done.update(r=post(api_server, {
        **CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "fits", "schema": enum_schema(3000)}}})))
    thread.start()
    waits = []
    while thread.is_alive():
        start = time.perf_counter()
        assert httpx.get(api_server + "health", timeout=30).status_code == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.05)
    assert done["r"].status_code == 200, done["r"].text
    # (a compile on the event loop held /health for seconds; on a CI machine whose cores other
    # tests keep busy one reply took 0.68 s with the loop free)
    assert len(waits) >= 3 and max(waits) < 2.0, waits


def test_a_slow_grammar_is_refused_after_its_time():
    """The compile-time bound (structured.Grammars): a grammar still compiling after
    ``max_seconds`` ends the request with a clear error."""
    from helpers import ROOT
    from unimax import load_tokenizer
    from unimax.errors import RequestError
    from unimax.structured import Grammars, ResponseFormat

    tokenizer = load_tokenizer(ROOT / "models" / "unimax-demo")
    grammars = Grammars(tokenizer, 4096, [1], max_seconds=0.01)
    with pytest.raises(RequestError, match="took over 0.01 s to compile"):
        grammars.compile(ResponseFormat("json_schema", json.dumps(enum_schema(2000))))


@pytest.fixture(scope="module")
def keyed_server():
    with running_app("--api-key", "key-of-alice", "--api-only",
                     env={"UNIMAX_API_KEY": "key-of-bob"}) as url:
        yield url


def test_api_keys_guard_the_api_and_metrics(keyed_server):
    r = post(keyed_server, CHAT)
    assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
    assert post(keyed_server, CHAT, Authorization="Bearer wrong").status_code == 401
    assert httpx.get(keyed_server + "metrics", timeout=30).status_code == 401
    assert httpx.get(keyed_server + "health", timeout=30).status_code == 200
    for key in ("key-of-alice", "key-of-bob"):  # the command line's and the environment's
        api = openai.OpenAI(base_url=keyed_server + "v1", api_key=key, max_retries=0)
        assert api.chat.completions.create(**CHAT).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server + "v1", api_key="nope",
                      max_retries=0).models.list()


def test_each_key_keeps_its_own_states(keyed_server):
    """reused_tokens told one client whether another had sent a prompt (a guessed PIN reused
    43 tokens, a wrong one 0): each key's conversations now live in a pool of its own."""
    secret = [{"role": "user", "content": "My PIN is 4821. What does os.path.join do?"}]

    def ask(key: str, messages: list[dict]):
        api = openai.OpenAI(base_url=keyed_server + "v1", api_key=key, max_retries=0,
                            timeout=120)
        return api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)

    reply = ask("key-of-alice", secret).choices[0].message.content
    probe = [*secret, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And os.getcwd?"}]
    assert ask("key-of-bob", probe).model_extra["unimax"]["reused_tokens"] == 0
    assert ask("key-of-alice", probe).model_extra["unimax"]["reused_tokens"] > 0


def test_the_page_asks_for_the_key():
    from gradio_client import Client

    with running_app("--api-key", "page-key") as url:
        with pytest.raises(ValueError):
            Client(url, verbose=False)
        client = Client(url, auth=("anyone", "page-key"), verbose=False)
        assert client.predict("Hello", "bf16", api_name="/chat")


def test_cors_origins_get_cors_headers():
    origin = "http://tools.example"
    with running_app("--api-only", "--cors-origins", origin) as url:
        preflight = httpx.options(url + "v1/chat/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == origin
        r = post(url, CHAT, Origin=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert post(url, CHAT, Origin="http://other.example").status_code == 403


def test_a_public_host_without_a_key_or_allowed_hosts_warns(capsys, monkeypatch):
    from app_server import free_port

    import unimax.service

    def stop(*_args, **_kwargs):
        raise ValueError("stopped before loading")

    monkeypatch.setattr(unimax.service, "EngineService", stop)
    monkeypatch.delenv("UNIMAX_API_KEY", raising=False)
    assert app_main(["--host", "0.0.0.0", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and "--allowed-hosts" in err
    assert app_main(["--host", "0.0.0.0", "--port", str(free_port()), "--api-key", "k",
                     "--allowed-hosts", "box.lan"]) == 2
    err = capsys.readouterr().err
    assert "without an API key" not in err and "--allowed-hosts" not in err
