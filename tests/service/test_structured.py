"""Structured output (``response_format``): a reply held to JSON or a JSON schema.

The reference is the naive twin: the demo model's full forward over the whole text at every
step (no cache), its logits masked by xgrammar's own transformers logits processor
(``xgrammar.contrib.hf.LogitsProcessor``), greedy, up to a stop token. The service serves such a
reply on the mode's engine, one token at a time (unimax.held): bf16 and verified must give
the twin's tokens, fp8 those of the twin whose steps after the first run the FP8 tail's forward (the
mode's decoder), behind a thinking block too; over HTTP the ``openai`` client's
structured-output helper (``chat.completions.parse`` with a pydantic model) must get its object.
"""

import json
import re

import pytest
import torch

import unimax
from helpers import DOC_SCHEMA as SCHEMA
from helpers import ROOT, grammar_processor, thinking_demo_model
from unimax.errors import RequestError
from unimax.fp8 import quantize_view
from unimax.logprobs import LogprobsRequest
from unimax.modes import APP_MODES
from unimax.presets import Preset
from unimax.service import EngineService
from unimax.settings import GenerationSettings
from unimax.structured import MAX_BLANKS_JSON, response_format, structured_outputs

DEMO = ROOT / "models" / "unimax-demo"
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]
FORMATS = {"json_object": {"type": "json_object"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "doc",
                                                                  "schema": SCHEMA}}}


def reference(folder, prompt: list[int], schema, n: int, stops: list[int],
              after: str | None = None, decode: str = "bf16") -> list[int]:
    """Greedy under xgrammar's transformers logits processor, on full forwards without a
    cache. ``schema``: a JSON schema, or a function of an xgrammar compiler that compiles the
    grammar; ``after``: the grammar starts once the reply's text holds this (a thinking
    block's end); ``decode`` "fp8": the tokens after the first from the FP8 tail's forward,
    as fp8 mode decodes them."""
    model = unimax.load_model(str(folder), device="cpu")
    decoder = quantize_view(model, "tail") if decode == "fp8" else model
    tokenizer = unimax.load_tokenizer(str(folder))
    processor = grammar_processor(
        tokenizer, model.config.vocab_size, stops,
        schema if callable(schema) else lambda c: c.compile_json_schema(
            json.dumps(schema), max_whitespace_cnt=MAX_BLANKS_JSON))
    reply: list[int] = []
    held = after is None
    for _ in range(n):
        ids = torch.tensor([prompt + reply])
        logits = (decoder if reply else model)(input_ids=ids).logits[:, -1].float()
        if held:
            logits = processor(ids, logits)
        token = int(logits.argmax())
        if token in stops:
            break
        reply.append(token)
        if not held and after in tokenizer.decode(reply):
            held = True
    return reply


def reply_of(service, mode: str, fmt: dict, n: int) -> dict:
    """The done event's data of a reply to QUESTION held to ``fmt``."""
    handle = service.submit("c", QUESTION, mode, GenerationSettings(max_new_tokens=n),
                            response_format=response_format(fmt))
    events = list(handle.events(timeout=300))
    assert events[-1].kind == "done", events[-1].text
    return events[-1].data


@pytest.fixture(scope="module")
def demo_service():
    service = EngineService(Preset(model=str(DEMO), device="cpu")).start()
    yield service
    service.stop()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("mode", ["bf16", "fp8", "verified"])
def test_replies_are_greedy_under_the_grammar_in_every_mode(demo_service, name, mode):
    schema = SCHEMA if name == "json_schema" else {"type": "object"}
    n = 128  # the demo model spends tokens on blanks between the fields
    prompt = demo_service.render(QUESTION)
    expected = reference(DEMO, prompt, schema, n, demo_service.stop_ids,
                         decode=APP_MODES[mode].decode if mode != "verified" else "bf16")
    handle = demo_service.submit("c", QUESTION, mode, GenerationSettings(max_new_tokens=n),
                                 response_format=response_format(FORMATS[name]))
    done = list(handle.events(timeout=300))[-1]
    assert done.kind == "done", done.text
    assert done.data["tokens"] == expected
    assert done.data["reply"] == demo_service.tokenizer.decode(expected)
    assert done.data["stats"]["mode"] == mode  # the mode's engine served it
    assert done.data["stats"]["response_format"] == name
    if mode == "verified":  # drafted under the grammar, checked against its masks
        assert done.data["stats"]["drafted_tokens"] > 0
    text = done.data["reply"]
    assert text.startswith("{")
    if name == "json_schema":  # finished: valid JSON, of the schema
        assert done.data["stopped"] == "stop"
        value = json.loads(text)
        assert set(value) == {"module", "kind", "stable"}
        assert value["module"] in SCHEMA["properties"]["module"]["enum"]
        assert isinstance(value["stable"], bool)
    # the same request without the format is not JSON: the grammar made the difference
    plain = demo_service.submit("c", QUESTION, mode, GenerationSettings(max_new_tokens=n))
    assert not list(plain.events(timeout=300))[-1].data["reply"].startswith("{")


@pytest.mark.parametrize("mode", ["bf16", "fp8", "verified"])
def test_the_grammar_starts_after_the_thinking_block(tmp_path, mode):
    """The thinking decodes in the mode's blocks (verified: drafted), the grammar holds from
    the token after </think>: each mode's twin (fp8: the FP8 tail's tokens after the first)."""
    # the demo's reply behind an open <think> uses "BytesIO": renamed, it closes the block
    folder = thinking_demo_model(tmp_path / "thinking", {"BytesIO": "</think>"})
    service = EngineService(Preset(model=str(folder), device="cpu")).start()
    try:
        prompt = service.render(QUESTION)
        handle = service.submit("c", QUESTION, mode, GenerationSettings(max_new_tokens=200),
                                response_format=response_format(FORMATS["json_schema"]))
        events = list(handle.events(timeout=300))
        stops = service.stop_ids
        exact = None
        if mode == "verified":  # and with logprobs, on the exact eager path (logprobs.py)
            exact = service.submit("e", QUESTION, mode, GenerationSettings(max_new_tokens=200),
                                   response_format=response_format(FORMATS["json_schema"]),
                                   logprobs=LogprobsRequest())
            exact = list(exact.events(timeout=300))[-1]
    finally:
        service.stop()
    assert events[0].kind == "queued" and events[-1].kind == "done", events[-1].text
    assert events[-1].data["tokens"] == reference(folder, prompt, SCHEMA, 200, stops,
                                                  after="</think>",
                                                  decode=APP_MODES[mode].decode
                                                  if mode != "verified" else "bf16")
    if mode == "verified":
        assert events[-1].data["stats"]["drafted_tokens"] > 0  # (the thinking: drafted)
        assert exact.data["stats"]["mode"] == "exact"
        assert exact.data["tokens"] == events[-1].data["tokens"]
    reasoning, answer = events[-1].data["reply"].split("</think>")
    assert reasoning and not reasoning.lstrip().startswith("{")
    assert set(json.loads(answer)) == {"module", "kind", "stable"}


# vLLM's structured_outputs: each kind, the reply it must give, and the grammar xgrammar compiles
# for it in the reference
STRUCTURED = {
    "choice": ({"choice": ["a function", "a class", "a module"]},
               lambda text: text in ("a function", "a class", "a module"),
               lambda c: c.compile_grammar('root ::= "a function" | "a class" | "a module"')),
    "regex": ({"regex": r"(os|json)\.[a-z]{2,6}"},
              lambda text: re.fullmatch(r"(os|json)\.[a-z]{2,6}", text),
              lambda c: c.compile_regex(r"(os|json)\.[a-z]{2,6}")),
    "grammar": ({"grammar": 'root ::= ("yes" | "no") ", " [a-z]{1,4}'},
                lambda text: re.fullmatch(r"(yes|no), [a-z]{1,4}", text),
                lambda c: c.compile_grammar('root ::= ("yes" | "no") ", " [a-z]{1,4}')),
}


@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_vllm_structured_outputs(demo_service, kind):
    raw, valid, compile_reference = STRUCTURED[kind]
    handle = demo_service.submit("c", QUESTION, "verified", GenerationSettings(max_new_tokens=24),
                                 response_format=structured_outputs(raw))
    events = list(handle.events(timeout=300))
    done = events[-1]
    assert done.kind == "done" and done.data["stopped"] == "stop", done.text
    assert valid(done.data["reply"]), done.data["reply"]
    assert done.data["tokens"] == reference(DEMO, demo_service.render(QUESTION),
                                            compile_reference, 24, demo_service.stop_ids)


@pytest.mark.parametrize("raw, fragment", [
    ("json", "must be an object"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({}, "exactly one"),
    ({"whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"json": "{not json"}, "JSON schema"),
    ({"regex": ""}, "non-empty string"),
])
def test_bad_structured_outputs_are_named(raw, fragment):
    with pytest.raises(RequestError, match=fragment):
        structured_outputs(raw)


@pytest.mark.parametrize("raw, fragment", [
    ({"type": "xml"}, "response_format must be"),
    ("json", "response_format must be"),
    ({"type": "json_schema"}, "needs \"json_schema\""),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "schema a JSON"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name must be"),
])
def test_bad_response_formats_are_named(raw, fragment):
    with pytest.raises(RequestError, match=fragment):
        response_format(raw)


def test_text_format_is_no_format():
    assert response_format(None) is None and response_format({"type": "text"}) is None


def test_a_schema_xgrammar_cannot_use_is_an_error_event_not_a_crash(demo_service):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    handle = demo_service.submit("c", QUESTION, "bf16", GenerationSettings(max_new_tokens=4),
                                 response_format=response_format(bad))
    events = list(handle.events(timeout=60))
    assert events[-1].kind == "error" and "'bad' cannot be used" in events[-1].text
    # the engine thread goes on
    assert reply_of(demo_service, "bf16", FORMATS["json_schema"], 128)["stopped"] == "stop"


# --- over HTTP, with the openai client ----------------------------------------------------

def test_openai_parse_gets_the_object(api_client, api_server):
    from typing import Literal

    import httpx
    import openai
    from pydantic import BaseModel

    class Doc(BaseModel):  # SCHEMA's fields
        module: Literal["json", "os", "re", "sys"]
        kind: Literal["function", "class", "constant"]
        stable: bool

    args = dict(model="unimax-demo", messages=QUESTION, max_tokens=128)
    parsed = api_client.chat.completions.parse(**args, response_format=Doc)
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Doc), message.content
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.model_extra["unimax"]["mode"] == "bf16"  # (the demo preset's mode)
    # streamed: the same text
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}
    whole = api_client.chat.completions.create(**args, response_format=fmt)
    pieces = [c.choices[0].delta.content or "" for c in api_client.chat.completions.create(
        **args, response_format=fmt, stream=True) if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert set(json.loads(whole.choices[0].message.content)) == set(SCHEMA["properties"])
    # refused, by name
    for body, param in [
            ({"response_format": {"type": "yaml"}}, "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/$defs/none"}}}}}}, None),
            ({"response_format": {"type": "json_object"},
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
             None)]:
        with pytest.raises(openai.BadRequestError) as err:
            api_client.chat.completions.create(**args, extra_body=body)
        assert err.value.status_code == 400
        if param:
            assert err.value.body["param"] == param
    # vLLM's structured_outputs, and its older guided_* names, on both routes
    choices = ["a function", "a class", "a module"]
    chat = api_client.chat.completions.create(
        **args, extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices
    old = api_client.chat.completions.create(**args, extra_body={"guided_choice": choices})
    assert old.choices[0].message.content == chat.choices[0].message.content
    completion = api_client.completions.create(
        model="unimax-demo", prompt="The os module is", max_tokens=16,
        extra_body={"structured_outputs": {"regex": "( [a-z]{2,8}){1,3}[.]"}})
    assert re.fullmatch("( [a-z]{2,8}){1,3}[.]", completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"
    for body, param, fragment in [
            ({"structured_outputs": {"regex": "([a"}}, None, "the regex cannot be used: Regex"),
            ({"structured_outputs": {"choice": ["x"]}, "guided_regex": "y"}, "guided_regex",
             "send one"),
            ({"structured_outputs": {"regex": "x", "whitespace_pattern": "y"}},
             "structured_outputs", "not supported")]:
        reply = httpx.post(api_server + "v1/completions", json={
            "model": "unimax-demo", "prompt": "x", "max_tokens": 4, **body})
        assert reply.status_code == 400 and fragment in reply.json()["error"]["message"]
        assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("mode", ["bf16", "verified"])
def test_sampled_replies_keep_to_the_schema(demo_service, mode):
    """Sampling draws from the model's distribution over the tokens the grammar allows: every
    seed's reply is the schema's JSON, and they are not all alike."""
    fmt = response_format(FORMATS["json_schema"])
    replies = []
    for seed in range(4):
        handle = demo_service.submit("c", QUESTION, mode, GenerationSettings(
            max_new_tokens=128, temperature=1.0, seed=seed), response_format=fmt)
        done = list(handle.events(timeout=300))[-1]
        assert done.kind == "done" and done.data["stopped"] == "stop", done.text
        value = json.loads(done.data["reply"])
        assert value["module"] in SCHEMA["properties"]["module"]["enum"]
        assert value["kind"] in SCHEMA["properties"]["kind"]["enum"]
        replies.append(done.data["reply"])
    assert len(set(replies)) > 1


def test_the_next_turn_starts_from_the_kept_state():
    """A reply held to a grammar keeps the state after its prompt: the conversation's next turn
    prefills only what is new, and still replies as the twin does on the whole prompt."""
    service = EngineService(Preset(model=str(DEMO), device="cpu")).start()
    try:
        done = reply_of(service, "verified", FORMATS["json_schema"], 128)
        turns = [*QUESTION, {"role": "assistant", "content": done["reply"]},
                 {"role": "user", "content": "And what does json.loads do?"}]
        handle = service.submit("c", turns, "bf16", GenerationSettings(max_new_tokens=128),
                                response_format=response_format(FORMATS["json_schema"]))
        events = list(handle.events(timeout=300))
        prompt, stops = service.render(turns), service.stop_ids
    finally:
        service.stop()
    started, second = events[1], events[-1]
    assert started.kind == "started" and second.kind == "done", second.text
    assert started.data["reused_tokens"] == len(service.render(QUESTION)) > 0
    assert second.data["stats"]["reused_tokens"] == started.data["reused_tokens"]
    assert second.data["tokens"] == reference(DEMO, prompt, SCHEMA, 128, stops)


def test_with_logprobs_the_exact_path_holds_the_grammar(demo_service):
    """Log-probabilities asked as well: the exact model's eager path serves the reply, masked
    there; the same tokens as the twin, each with the model's own log-probability."""
    from unimax.logprobs import LogprobsRequest

    handle = demo_service.submit("c", QUESTION, "bf16", GenerationSettings(max_new_tokens=128),
                                 logprobs=LogprobsRequest(top=2),
                                 response_format=response_format(FORMATS["json_schema"]))
    events = list(handle.events(timeout=300))
    done = events[-1]
    assert done.kind == "done" and done.data["stats"]["mode"] == "exact", done.text
    entries = [item for e in events for item in e.data.get("logprobs", [])]
    assert [item["token"] for item in entries] == done.data["tokens"] == reference(
        DEMO, demo_service.render(QUESTION), SCHEMA, 128, demo_service.stop_ids)
    assert all(len(item["top"]) == 2 and item["logprob"] <= 0 for item in entries)
