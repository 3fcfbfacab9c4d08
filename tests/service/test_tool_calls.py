"""Tool calls (unimax/tool_calls.py, the API's ``tools``): the parser fed in pieces against
transformers' own ``parse_response`` on the whole text, at every cut; prompts with tools and tool
turns against transformers' ``apply_chat_template``; and the app over HTTP with the ``openai``
client, on the demo model with Qwen3.5's tool template and two pieces of its vocabulary renamed
so that its real greedy reply is a tool call."""

import json
import random
from types import SimpleNamespace

import openai
import pytest
from transformers.cli.serving.utils import get_response_template
from transformers.utils.chat_parsing import parse_response

from helpers import QWEN35_TOOLS_TEMPLATE, ROOT, demo_variant, reference_chat_reply
from unimax.chat import check_messages, encode_chat
from unimax.errors import RequestError
from unimax.tool_calls import ToolCallParser, call_format, call_grammar, check_tools

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The documentation of a Python standard library function.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "description": "the function, e.g. os.path.join"},
        "lines": {"type": "integer"}}, "required": ["name"]}}}]
XML = call_format(SimpleNamespace(chat_template=QWEN35_TOOLS_TEMPLATE))
JSON = call_format(SimpleNamespace(chat_template="{{ tools }}<tool_call>"))


def xml_call(function: str, **arguments) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={function}>\n{params}</function>\n</tool_call>"


def json_call(function: str, **arguments) -> str:
    call = json.dumps({'name': function, 'arguments': arguments})
    return f"<tool_call>\n{call}\n</tool_call>"


def streamed(spec, pieces: list[str], first_only: bool = False):
    parser, reasoning, content, calls = ToolCallParser(spec, TOOLS, first_only), "", "", []
    for piece in pieces + [None]:
        parts = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content, calls = (reasoning + parts.reasoning, content + parts.content,
                                     calls + parts.calls)
    return reasoning, content, calls


def reference_calls(spec, text: str) -> list[dict]:
    """transformers' parse of the whole text, with the arguments as the JSON text the API
    sends."""
    calls = parse_response(text, spec, prefix="", tools=TOOLS).get("tool_calls") or []
    return [{"name": c["function"]["name"],
             "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}
            for c in calls]


REPLIES = [
    (XML, "Let me look.\n\n" + xml_call("lookup", name="os.path.join", lines=3), "Let me look."),
    (XML, xml_call("lookup", name="a < b & é") + "\n" + xml_call("lookup", name="x"), ""),
    (XML, "Plain answer, no call: a <tool and <function=x> alone.", None),
    (XML, "Before " + xml_call("lookup", name="zip") + " and after.", "Before and after."),
    (JSON, "Sure. " + json_call("lookup", name="json.dumps", lines="2"), "Sure."),
    (JSON, json_call("lookup", name="x") + json_call("lookup", name="y") + "\n", ""),
]


@pytest.mark.parametrize("spec,text,content", REPLIES)
def test_every_cut_matches_transformers_parse(spec, text, content):
    expected_calls = reference_calls(spec, text)
    assert bool(expected_calls) == (content is not None)
    expected = ("", text if content is None else content, expected_calls)
    assert streamed(spec, [text]) == expected
    for i in range(len(text) + 1):
        assert streamed(spec, [text[:i], text[i:]]) == expected, i
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), 4))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(spec, pieces) == expected, cuts


@pytest.mark.parametrize("spec", [XML, JSON], ids=["xml", "json"])
def test_text_without_a_call_passes_through_unchanged(spec):
    rng = random.Random(0)
    alphabet = ["a", " ", "\n", "<", ">", "/", "tool", "_call", "<tool_call", "<function=",
                "</tool_call>", "{", "}", "é", "\t", "</"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        if "<tool_call>" in text:
            continue
        cut = rng.randint(0, len(text))
        assert streamed(spec, [text[:cut], text[cut:]]) == ("", text, []), repr(text)


def test_unfinished_or_malformed_calls_stay_text():
    cut = "Checking.\n" + xml_call("lookup", name="os.path.join")[:-20]
    assert streamed(XML, [cut]) == ("", cut, [])
    bad = "Sure " + '<tool_call>\n{"name": "lookup", "arguments": {"na</tool_call> then more'
    for pieces in ([bad], [bad[:12], bad[12:]], list(bad)):
        assert streamed(JSON, pieces) == ("", bad, [])


def test_parallel_tool_calls_false_keeps_the_first():
    first = xml_call("lookup", name="a")
    parser = ToolCallParser(XML, TOOLS, first_only=True)
    parts = parser.feed(first + "\n<tool")  # the call ends where nothing can extend it
    assert [c["arguments"] for c in parts.calls] == ['{"name": "a"}'] and parser.done
    parts = parser.feed("_call>\n<function=lookup>\n</function>\n</tool_call>")
    parts += parser.finish()
    assert parts.calls == [] and parts.content == ""
    assert streamed(XML, [first + "\n" + xml_call("lookup", name="b")], first_only=True) == \
        ("", "", [{"name": "lookup", "arguments": '{"name": "a"}'}])


def test_call_format_follows_the_chat_template():
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(ROOT / "models" / "unimax-demo")
    assert call_format(demo) is None  # its template never shows the model any tools
    # transformers serve's response templates for Qwen3.5 and for Qwen3 (Hermes)
    config = SimpleNamespace(model_type="qwen3_5")
    assert XML == get_response_template(SimpleNamespace(), SimpleNamespace(config=config,
                                                                           **vars(config)))
    config = SimpleNamespace(model_type="qwen3")
    hermes = "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}"
    assert call_format(SimpleNamespace(chat_template=hermes)) == JSON == get_response_template(
        SimpleNamespace(), SimpleNamespace(config=config, **vars(config)))
    own = {"fields": {"tool_calls": {}}}  # a tokenizer's own template comes first
    assert call_format(SimpleNamespace(chat_template=hermes, response_template=own)) is own
    assert call_format(SimpleNamespace(chat_template="{{ tools }} in no known format")) is None
    # the grammars that force a call: xgrammar's structural tags for the two formats
    assert call_grammar(SimpleNamespace(chat_template=QWEN35_TOOLS_TEMPLATE)) == "qwen_3_5"
    assert call_grammar(SimpleNamespace(chat_template=hermes)) == "qwen_3"
    assert call_grammar(demo) is None
    assert call_grammar(SimpleNamespace(chat_template=hermes, response_template=own)) is None


@pytest.mark.parametrize("tools,fragment", [
    ("lookup", "non-empty list"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"function": {"name": "f"}}], "type 'function'"),
    ([{"type": "function", "function": {"name": "has space"}}], "name must be"),
    ([TOOLS[0], TOOLS[0]], "two tools are named"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "JSON Schema"),
])
def test_bad_tools_are_refused_by_name(tools, fragment):
    with pytest.raises(RequestError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_tools(tools)


# A conversation with a call and its results, as chat templates read them
TOOL_TURNS = [
    {"role": "user", "content": "What does json.dumps do?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {
         "name": "lookup", "arguments": {"name": "json.dumps", "lines": 2}}}]},
    {"role": "tool", "content": "Serialize obj to a formatted str."},
    {"role": "tool", "content": "(see also json.dump)"},
]


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = demo_variant(tmp_path_factory.mktemp("m") / "tools-model", QWEN35_TOOLS_TEMPLATE)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("turns", [1, 3, 4])
def test_prompts_with_tools_match_transformers(tools_tokenizer, turns):
    messages = TOOL_TURNS[:turns]
    check_messages(messages, max_chars=10**6)
    expected = tools_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                                   add_generation_prompt=True,
                                                   return_dict=False)
    assert encode_chat(tools_tokenizer, messages, tools=TOOLS) == list(expected)
    # control-token text in a message still goes in as characters, the rest unchanged
    spelled = [{**messages[0], "content": "What does <|im_start|> do?"}, *messages[1:]]
    ids = encode_chat(tools_tokenizer, spelled, tools=TOOLS)
    assert tools_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert ids.count(ids[0]) == list(expected).count(ids[0])


def test_tool_turns_are_checked(tools_tokenizer):
    with pytest.raises(RequestError, match="only an assistant"):
        check_messages([{"role": "user", "content": "x", "tool_calls": []}], 100)
    with pytest.raises(RequestError, match="arguments as an object"):
        check_messages([TOOL_TURNS[0], {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{}"}}]}, TOOL_TURNS[2]], 100)
    with pytest.raises(RequestError, match="end with a user message"):
        check_messages(TOOL_TURNS[:2], 1000)
    with pytest.raises(RequestError, match="more than this model's context"):
        check_messages(TOOL_TURNS[:1], 30, extra_chars=20)
    evil = [{"type": "function", "function": {"name": "f", "description": "<|im_start|>"}}]
    with pytest.raises(RequestError, match="control-token text"):
        encode_chat(tools_tokenizer, TOOL_TURNS[:1], tools=evil)


# --- the app over HTTP ---------------------------------------------------------------------

QUESTION = TOOL_TURNS[:1]
# The demo model's greedy reply to QUESTION with TOOLS in Qwen3.5's template is "Serialize
# ``obj`` to a JSON formatted ``str``.": renamed, "▁JSON" opens a call to lookup and "``." closes
# it, so the same reply calls lookup(name="formatted ``str"). Neither piece is in the prompt.
RENAMED = {"▁JSON": "\n\n<tool_call>\n<function=lookup>\n<parameter=name>\n",
           "``.": "\n</parameter>\n</function>\n</tool_call>"}
MODEL = "tools-model:bf16"


@pytest.fixture(scope="module")
def tools_app(tmp_path_factory):
    from app_server import running_app
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("app")
    plain = demo_variant(root / "plain", QWEN35_TOOLS_TEMPLATE)
    folder = demo_variant(root / "tools-model", QWEN35_TOOLS_TEMPLATE, renamed=RENAMED)
    # the renaming leaves the prompts' ids as they were, and so the model's replies
    for messages in (QUESTION, TOOL_TURNS):
        before, after = (AutoTokenizer.from_pretrained(f).apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
            return_dict=False) for f in (plain, folder))
        assert list(before) == list(after)
    with running_app("--model", str(folder)) as url:
        api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
        yield api, folder


def test_a_reply_that_calls_a_tool_comes_back_as_tool_calls(tools_app):
    api, folder = tools_app
    text, prompt_tokens = reference_chat_reply(folder, QUESTION, 32, tools=TOOLS)
    expected = parse_response(text, call_format(SimpleNamespace(
        chat_template=QWEN35_TOOLS_TEMPLATE)), prefix="", tools=TOOLS)
    assert expected["tool_calls"][0]["function"] == {
        "name": "lookup", "arguments": {"name": "formatted ``str"}}
    args = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=32)
    response = api.chat.completions.create(**args)
    assert response.usage.prompt_tokens == prompt_tokens  # the tools are in the prompt
    reply = response.choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content == expected["content"] == "Serialize ``obj`` to a"
    [call] = reply.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "lookup"
    assert json.loads(call.function.arguments) == {"name": "formatted ``str"}
    # streamed: the same text and call; the call's markup never shows in the content
    content, calls, finish = "", [], None
    for chunk in api.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == reply.message.content and finish == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(0, "lookup", call.function.arguments)]
    # the tool's result goes back; the model answers from the template's rendering of it
    follow = [*QUESTION, reply.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Serialize obj."}]
    second = api.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS,
                                         max_tokens=24)
    turns = [*QUESTION, {"role": "assistant", "content": expected["content"],
                         "tool_calls": expected["tool_calls"]}, follow[-1]]
    text, prompt_tokens = reference_chat_reply(folder, turns, 24, tools=TOOLS)
    assert second.usage.prompt_tokens == prompt_tokens
    # the template writes the call back otherwise than the renamed pieces spelled it: the
    # state kept after the first prompt starts the second
    assert second.model_extra["unimax"]["reused_tokens"] == response.usage.prompt_tokens
    assert second.choices[0].message.content == parse_response(
        text, call_format(SimpleNamespace(chat_template=QWEN35_TOOLS_TEMPLATE)),
        prefix="", tools=TOOLS).get("content", "")


def test_a_call_cut_short_stays_text(tools_app):
    api, folder = tools_app
    text, _ = reference_chat_reply(folder, QUESTION, 10, tools=TOOLS)
    assert "<tool_call>" in text and "</tool_call>" not in text
    reply = api.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                        max_tokens=10).choices[0]
    assert reply.finish_reason == "length" and not reply.message.tool_calls
    assert reply.message.content == text
    stopped = api.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                          max_tokens=32, stop=["str"]).choices[0]
    assert stopped.finish_reason == "stop" and not stopped.message.tool_calls
    assert stopped.message.content == text.split("str")[0]  # "... formatted ``"


def test_tool_choice_none_keeps_the_tools_from_the_model(tools_app):
    api, folder = tools_app
    text, _ = reference_chat_reply(folder, QUESTION, 16)
    reply = api.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                        tool_choice="none", max_tokens=16).choices[0]
    assert reply.message.content == text and not reply.message.tool_calls


# a tool whose arguments are closed choices, which the demo model (no tool training) finishes
DESCRIBE = {"type": "function", "function": {
    "name": "describe", "description": "What kind of thing a standard library name is.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["module", "kind"],
                   "properties": {"module": {"enum": ["json", "os", "re"]},
                                  "kind": {"enum": ["function", "class"]}}}}}
COUNT = {"type": "function", "function": {
    "name": "count", "description": "How many names a standard library module has.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["module"],
                   "properties": {"module": {"enum": ["json", "os", "re"]}}}}}


def forced_reference(folder, tools: list[dict], choice, n: int, grammar: str = "qwen_3_5"
                     ) -> str:
    """The twin of a forced call: the model stepped through the transformers call convention
    (a prefill, then one token at a time on its cache), masked by xgrammar's transformers
    logits processor over its own structural tag for the call format (Qwen3.5's by default),
    greedy to the stop token; the reply's text."""
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    import unimax
    from helpers import grammar_processor
    from unimax.structured import MAX_BLANKS_CALL

    tok = AutoTokenizer.from_pretrained(folder)
    model = unimax.load_model(str(folder), device="cpu")
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    tag = xgr.get_model_structural_tag(grammar, tools=tools, tool_choice=choice,
                                       reasoning="disabled", max_whitespace_cnt=MAX_BLANKS_CALL)
    processor = grammar_processor(tok, model.config.vocab_size, stops,
                                  lambda c: c.compile_structural_tag(tag))
    ids = list(tok.apply_chat_template(QUESTION, tools=tools, add_generation_prompt=True,
                                       tokenize=True, return_dict=False))
    reply, cache, step = [], model.make_recurrent_cache(), ids
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([step]), past_key_values=cache,
                           use_cache=True).logits[:, -1].float()
            token = int(processor(torch.tensor([ids + reply]), logits).argmax())
            if token in stops:
                break
            reply.append(token)
            step = [token]
    return tok.decode(reply, skip_special_tokens=True)


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "describe"}}])
def test_tool_choice_forces_a_call_in_the_models_format(tools_app, choice):
    api, folder = tools_app
    tools = [DESCRIBE, COUNT]  # (offered lookup, whose argument is free text, it rambles)
    args = dict(model=MODEL, messages=QUESTION, tools=tools, tool_choice=choice,
                max_tokens=160)
    reply = api.chat.completions.create(**args)
    text = forced_reference(folder, tools, choice, 160)
    expected = parse_response(text, XML, prefix="", tools=tools)
    [want] = expected["tool_calls"]
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        (want["function"]["name"], want["function"]["arguments"])
    # (xgrammar's "required" lets text come before the calls, as the model's format does)
    # (and a reply's leading blank: the detokenizers differ on it)
    assert (reply.choices[0].message.content or "").strip() == \
        (expected.get("content") or "").strip()
    assert reply.model_extra["unimax"]["mode"] == "bf16"  # (the preset's mode's engine served it)
    if isinstance(choice, dict):
        assert call.function.name == "describe"
    streamed = [c for chunk in api.chat.completions.create(**args, stream=True)
                for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(call.function.name, call.function.arguments)]


# Qwen3's (Hermes') JSON calls, in the demo's ChatML
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role "
    "+ '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_forced_call_in_qwen3_json_format(tmp_path):
    from transformers import AutoTokenizer

    from unimax.presets import Preset
    from unimax.service import EngineService
    from unimax.settings import GenerationSettings
    from unimax.structured import ToolCallFormat

    folder = demo_variant(tmp_path / "hermes", HERMES_TEMPLATE)
    assert call_grammar(AutoTokenizer.from_pretrained(folder)) == "qwen_3"
    service = EngineService(Preset(model=str(folder), device="cpu")).start()
    try:
        forced = ToolCallFormat("qwen_3", json.dumps([DESCRIBE]), "describe")
        handle = service.submit("c", QUESTION, "verified", GenerationSettings(max_new_tokens=96),
                                tools=[DESCRIBE], response_format=forced)
        done = list(handle.events(timeout=300))[-1]
    finally:
        service.stop()
    assert done.kind == "done" and done.data["stopped"] == "stop", done.text
    text = forced_reference(folder, [DESCRIBE], {"type": "function", "function": {
        "name": "describe"}}, 96, grammar="qwen_3")
    assert done.data["reply"].strip() == text.strip()
    [call] = parse_response(text, JSON, prefix="", tools=[DESCRIBE])["tool_calls"]
    assert call["function"]["name"] == "describe"
    assert set(call["function"]["arguments"]) == {"module", "kind"}


def test_openai_parse_with_a_forced_pydantic_tool(tools_app):
    """The openai client's structured tool calls (as instructor and LangChain's
    with_structured_output send them): a strict function tool from a pydantic model, forced by
    name; the call's arguments come back parsed into the model."""
    from typing import Literal

    from pydantic import BaseModel

    class Describe(BaseModel):
        module: Literal["json", "os", "re"]
        kind: Literal["function", "class"]

    api, _ = tools_app
    tool = openai.pydantic_function_tool(Describe)
    reply = api.chat.completions.parse(
        model=MODEL, messages=QUESTION, tools=[tool], max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "Describe"}})
    [call] = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Describe)


@pytest.mark.parametrize("kwargs,param,fragment", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name must be"),
    ({"extra_body": {"parallel_tool_calls": "yes"}}, "parallel_tool_calls", "true or false"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]}, "messages", "JSON object"),
])
def test_bad_tool_requests_are_400s(tools_app, kwargs, param, fragment):
    api, _ = tools_app
    args = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(**args)
    assert err.value.body["param"] == param and fragment in err.value.body["message"]
