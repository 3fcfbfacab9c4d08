"""The OpenAI-compatible API, driven by the official ``openai`` client (and raw HTTP where a
client hides what it sends) against the real app over HTTP, on its default preset (the demo
model): every mode, streaming, usage, stop strings, seeds, errors, disconnects, kept states,
and page requests interleaved with API ones."""

import json
import threading
import time

import httpx
import openai
import pytest
from app_server import running_app
from gradio_client import Client

MODEL = "unimax-demo"
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]




def metric(server, name: str, **labels) -> float:
    text = httpx.get(server + "metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_models_list_every_mode(api_client):
    ids = {m.id for m in api_client.models.list()}
    assert ids == {MODEL, f"{MODEL}:bf16", f"{MODEL}:fp8", f"{MODEL}:verified"}


@pytest.mark.parametrize("mode", ["bf16", "fp8", "verified"])
def test_chat_in_each_mode_stream_equals_non_stream(api_client, mode):
    reply = api_client.chat.completions.create(model=f"{MODEL}:{mode}", messages=QUESTION,
                                           max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    extra = reply.model_extra["unimax"]
    assert extra["mode"] == mode and extra["bridge_mib"] > 0
    if mode == "verified":
        assert 0 <= extra["acceptance_rate"] <= 1
    stream = api_client.chat.completions.create(model=f"{MODEL}:{mode}", messages=QUESTION,
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text  # greedy: the streamed text is the non-streamed text
    assert len([p for p in pieces if p]) >= 2 and finish == reply.choices[0].finish_reason
    assert usage.completion_tokens == reply.usage.completion_tokens


def test_completions_continue_raw_text(api_client):
    out = api_client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16,
                                    temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens > 0
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra", [{}, {"logprobs": 0}], ids=["engine", "exact"])
def test_a_completion_reads_on_from_its_prompt(api_client, extra):
    """prompt + completion is the text of prompt + reply tokens: the completion's first word
    keeps the leading space SentencePiece drops from a text's first word (it read "The os
    module isnot optional." before), streamed or not, on the engines' path and the exact one."""
    import torch

    import unimax
    from helpers import ROOT

    folder = ROOT / "models" / "unimax-demo"
    tok, model = unimax.load_tokenizer(folder), unimax.load_model(folder, device="cpu")
    prompt = "The os module is"
    ids = tok.encode(prompt)
    reply = unimax.exact_greedy_tokens(model, torch.tensor([ids]), 6)[0].tolist()
    ends = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    reply = reply[:next((i for i, t in enumerate(reply) if t in ends), len(reply))]
    want = tok.decode(ids + reply, skip_special_tokens=True)
    assert want.startswith(prompt + " ")
    args = dict(model=f"{MODEL}:bf16", prompt=prompt, max_tokens=6, temperature=0, **extra)
    text = api_client.completions.create(**args).choices[0].text
    assert prompt + text == want
    streamed = "".join(c.choices[0].text for c in api_client.completions.create(**args,
                                                                              stream=True))
    assert streamed == text


def test_stop_strings_cut_the_reply(api_client):
    full = api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                          temperature=0).choices[0].message.content
    word = next(w for w in full.split()[2:] if len(w) > 2)
    cut = api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                         temperature=0, stop=[word, "@@never@@"])
    assert cut.choices[0].message.content == full[:full.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in api_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=word, stream=True)
        if c.choices)
    assert streamed == cut.choices[0].message.content


def test_seeds_reproduce_samples(api_client):
    def sample(seed):  # an open prompt, a hot temperature: the demo model is sure of its docs
        return api_client.chat.completions.create(
            model=f"{MODEL}:bf16", messages=[{"role": "user", "content": "Say anything."}],
            max_tokens=24, temperature=1.5, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize("kwargs,status,param", [
    ({"n": 2}, 400, "n"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     400, None),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"seed": -5}, 400, "seed"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hello " * 6000}]}, 400, None),
    # other servers' sampling extensions are refused, not ignored
    ({"extra_body": {"typical_p": 0.9}}, 400, "typical_p"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, 400, "min_p"),
    ({"extra_body": {"stop_token_ids": [3]}}, 400, "stop_token_ids"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, 400, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": "no"}}}, 400,
     "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": ["enable_thinking"]}}, 400,
     "chat_template_kwargs"),
    # past float32's range a temperature made every request a 500; top_k past 64 bits too
    ({"temperature": 1e39}, 400, "temperature"),
    ({"extra_body": {"top_k": 2**63}}, 400, "top_k"),
    ({"extra_body": {"top_k": 10**30}}, 400, "top_k"),
    # JSON's true and 1.0 are not the integer 1, nor 1 the boolean true
    ({"n": True}, 400, "n"),
    ({"n": 1.0}, 400, "n"),
    ({"logprobs": 1}, 400, "logprobs"),
    ({"extra_body": {"stream": "yes"}}, 400, "stream"),
    # output that is not text is refused, not silently left out
    ({"modalities": ["text", "audio"]}, 400, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
])
def test_errors_in_openai_shape(api_client, kwargs, status, param):
    args = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        api_client.chat.completions.create(**args)
    assert err.value.status_code == status, err.value
    body = err.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["message"]
    if param:
        assert body["param"] == param
    assert api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "verified"])
def test_penalties_apply_in_every_mode(api_client, mode):
    """presence_penalty, frequency_penalty and repetition_penalty change the reply (greedy) in
    every mode, the same reply in bf16 and verified (exact under the penalties) and through
    the exact path that serves logprobs."""
    penalized = dict(presence_penalty=2.0, frequency_penalty=2.0,
                     extra_body={"repetition_penalty": 3.0})  # (the demo model is sure of
    # its short answers)

    def reply(model, **kwargs):
        out = api_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                                 temperature=0, **kwargs)
        return out.choices[0].message.content

    plain, pen = reply(f"{MODEL}:{mode}"), reply(f"{MODEL}:{mode}", **penalized)
    assert pen and pen != plain
    if mode != "fp8":  # (fp8 mode decodes with the FP8 tail, not the exact model)
        assert pen == reply(f"{MODEL}:bf16", **penalized)
        assert pen == reply(f"{MODEL}:bf16", logprobs=True, **penalized)


def test_neutral_extension_values_are_accepted(api_client, api_server):
    """What chat front ends send with a sampler turned off passes; a completions prompt has
    no template to take chat_template_kwargs."""
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "top_a": 0, "typical_p": 1,
               "presence_penalty": 0, "stop_token_ids": [],
               "chat_template_kwargs": {"enable_thinking": None}}
    assert api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                              extra_body=neutral).choices[0].message.content
    r = httpx.post(api_server + "v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "json", "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_switch_thinking(tmp_path):
    """Qwen's documented way to turn thinking off through an OpenAI-compatible server,
    extra_body={"chat_template_kwargs": {"enable_thinking": False}}, reaches the template: the
    prompt is the one transformers' apply_chat_template renders with that switch."""
    from transformers import AutoTokenizer

    from helpers import thinking_demo_model

    folder = thinking_demo_model(tmp_path / "thinking-model")
    reference = AutoTokenizer.from_pretrained(folder)

    def expected(**switch):
        return len(reference.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False, **switch))

    assert expected(enable_thinking=False) > expected()  # the switch shows in the prompt
    with running_app("--model", str(folder)) as url:
        api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
        for switch in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            reply = api.chat.completions.create(model="thinking-model", messages=QUESTION,
                                                max_tokens=2,
                                                extra_body={"chat_template_kwargs": switch})
            assert reply.usage.prompt_tokens == expected(**switch), switch


def test_malformed_json_is_a_400(api_server):
    r = httpx.post(api_server + "v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_what_is_not_served_is_answered_in_the_api_error_shape(api_client, api_server):
    """A client calling an endpoint this server lacks learns which and what is served, in
    OpenAI's error shape (it got Starlette's bare {"detail": "Not Found"} before)."""
    with pytest.raises(openai.NotFoundError) as err:
        api_client.embeddings.create(model=MODEL, input="hi")
    assert "POST /v1/embeddings" in err.value.message, err.value.message
    assert "POST /v1/chat/completions" in err.value.message
    assert err.value.code == "unknown_url"
    r = httpx.get(api_server + "v1/chat/completions", timeout=30)
    assert r.status_code == 405 and "takes POST" in r.json()["error"]["message"], r.text
    r = httpx.get(api_server + "v1/models/", timeout=30, follow_redirects=True)
    assert r.status_code == 200 and MODEL in {m["id"] for m in r.json()["data"]}
    assert httpx.get(api_server, timeout=30).status_code == 200  # the page is still at /


def test_resent_conversation_prefills_only_the_new_turn(api_client):
    first = api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12)
    history = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "And json.loads?"}]
    second = api_client.chat.completions.create(model=MODEL, messages=history, max_tokens=12)
    extra = second.model_extra["unimax"]
    assert extra["reused_tokens"] >= first.usage.prompt_tokens
    assert extra["prefilled_tokens"] < second.usage.prompt_tokens


def test_disconnect_cancels_the_request(api_server):
    before = metric(api_server, "unimax_requests_total", outcome="cancelled")
    body = {"model": f"{MODEL}:bf16", "messages": QUESTION, "max_tokens": 3000,
            "stream": True}
    with httpx.stream("POST", api_server + "v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "content" in line:
                break  # one piece of text, then the client goes away
    deadline = time.time() + 30
    while metric(api_server, "unimax_requests_total", outcome="cancelled") <= before:
        assert time.time() < deadline, "the request was not cancelled"
        time.sleep(0.2)
    health = httpx.get(api_server + "health", timeout=10).json()
    assert health["status"] == "ok"


def test_page_and_api_requests_interleave(api_server, api_client):
    page = Client(api_server, verbose=False)
    results = {}

    def via_page():
        results["page"] = page.predict("What does csv.reader do?", "fp8", api_name="/chat")

    thread = threading.Thread(target=via_page)
    thread.start()
    api = [api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)
           for _ in range(3)]
    thread.join(120)
    assert results["page"] and all(r.choices[0].message.content for r in api)


def test_metrics_and_health(api_server, api_client):
    api_client.chat.completions.create(model=f"{MODEL}:verified", messages=QUESTION, max_tokens=16)
    text = httpx.get(api_server + "metrics", timeout=30).text
    for name in ("unimax_generated_tokens_total", "unimax_decode_tokens_per_second",
                 "unimax_prefill_tokens_per_second", "unimax_acceptance_rate",
                 "unimax_bridge_seconds", "unimax_queue_length", "unimax_requests_total"):
        assert name in text, name
    assert metric(api_server, "unimax_generated_tokens_total", mode="verified") > 0
    assert json.loads(httpx.get(api_server + "health", timeout=10).text)["model"] == MODEL
    deadline = time.time() + 60  # the app serves while it warms every mode up, then says so
    while (health := httpx.get(api_server + "health", timeout=10).json())["warm_up"]["pending"] \
            or health["warm_up"]["running"]:
        assert time.time() < deadline, health
        time.sleep(0.2)
    assert sorted(health["warm_up"]["ready"]) == ["bf16", "fp8", "verified"], health
    assert health["warm_up"]["error"] is None


def test_api_only_serves_the_api_without_the_page():
    with running_app("--api-only") as url:
        assert httpx.get(url, timeout=10).status_code == 404
        api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0)
        assert api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)


def test_verified_mode_samples_reproducibly(api_client):
    """A temperature in verified mode samples (speculative sampling): the same seed gives the
    same reply."""
    args = dict(model=f"{MODEL}:verified", messages=QUESTION, max_tokens=12, temperature=0.8,
                seed=3)
    first = api_client.chat.completions.create(**args)
    again = api_client.chat.completions.create(**args)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens > 0


@pytest.mark.parametrize("mode", ["bf16", "verified"])
def test_min_p_reaches_the_sampler(api_client, mode):
    """min_p 1 keeps only the likeliest token: a hot sampled reply is then the greedy one (in
    verified mode through the speculative rule's warped distributions); min_p 0 at the same
    temperature and seed is not."""
    args = dict(model=f"{MODEL}:{mode}", messages=QUESTION, max_tokens=24, seed=3)
    greedy = api_client.chat.completions.create(**args, temperature=0)
    hot = dict(args, temperature=2.0)
    held = api_client.chat.completions.create(**hot, extra_body={"min_p": 1.0})
    free = api_client.chat.completions.create(**hot, extra_body={"min_p": 0})
    assert held.choices[0].message.content == greedy.choices[0].message.content
    assert free.choices[0].message.content != greedy.choices[0].message.content


def test_input_that_broke_the_parser_or_the_tokenizer_is_a_400(api_server):
    """JSON nested ~1000 deep and lone surrogates (in a tool's description, in a call's
    arguments) gave internal 500s in plain text."""
    deep = b'{"model": "unimax-demo", "messages": [], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = httpx.post(api_server + "v1/chat/completions", content=deep, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
    tool = {"type": "function", "function": {"name": "f", "description": "bad \\ud800",
                                             "parameters": {"type": "object"}}}
    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f",
                                                     "arguments": '{"a": "\\udfff"}'}}]}
    for body in ({"tools": [tool]},
                 {"messages": [*QUESTION, call, {"role": "tool", "tool_call_id": "c1",
                                                 "content": "1"}]}):
        text = json.dumps({"model": MODEL, "messages": QUESTION, **body}).replace("\\\\u", "\\u")
        r = httpx.post(api_server + "v1/chat/completions", content=text.encode(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_a_vanishing_temperature_is_greedy(api_client):
    """logits / 1e-39 overflowed and sampled random tokens; below 1e-5 a temperature is greedy
    decoding."""
    args = dict(model=f"{MODEL}:bf16", messages=QUESTION, max_tokens=16)
    greedy = api_client.chat.completions.create(**args, temperature=0)
    for tiny in (1e-39, 1e-6):
        reply = api_client.chat.completions.create(**args, temperature=tiny, seed=5)
        assert reply.choices[0].message.content == greedy.choices[0].message.content


def test_a_model_is_retrieved_by_id(api_client):
    model = api_client.models.retrieve(f"{MODEL}:verified")
    assert model.id == f"{MODEL}:verified" and model.model_extra["unimax_mode"] == "verified"
    with pytest.raises(openai.NotFoundError):
        api_client.models.retrieve("gpt-4")


def test_a_closed_non_streaming_request_is_cancelled(api_server):
    """A client that gives up on a non-streaming reply: the engine stops within a block (it
    generated the whole reply before, its events never pausing for the disconnect check)."""
    before = metric(api_server, "unimax_requests_total", outcome="cancelled")
    # (sampled hot with this seed, the demo model writes ~550 tokens, ~6 s on a CPU)
    body = {"model": f"{MODEL}:bf16", "messages": QUESTION, "max_tokens": 3000,
            "temperature": 3, "seed": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api_server + "v1/chat/completions", json=body, timeout=1.5)
    deadline = time.time() + 30
    while metric(api_server, "unimax_requests_total", outcome="cancelled") <= before:
        assert time.time() < deadline, "the request was not cancelled"
        time.sleep(0.2)


def test_waiting_requests_do_not_slow_the_running_stream(api_server):
    """Forty queued requests each held a thread polling for events, and the running stream's
    gap between chunks grew tenfold (0.22 s to 2.24 s)."""
    body = {"model": f"{MODEL}:bf16", "messages": QUESTION, "stream": True, "max_tokens": 600,
            "temperature": 3, "seed": 3}  # (a long reply: see the test above)

    def gaps(during=None) -> list[float]:
        """The gaps between the stream's chunks after its fifth (after ``during()`` has
        returned, where given)."""
        times = []
        with httpx.stream("POST", api_server + "v1/chat/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    times.append(time.perf_counter())
                    if len(times) == 5 and during:
                        during()
                        during, times = None, []
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    alone = gaps()
    waiting = []

    def queue_forty():
        for _ in range(40):
            thread = threading.Thread(target=lambda: httpx.post(
                api_server + "v1/chat/completions", timeout=300, json={
                    "model": f"{MODEL}:bf16", "messages": QUESTION, "max_tokens": 1}))
            thread.start()
            waiting.append(thread)

    crowded = gaps(queue_forty)
    for thread in waiting:
        thread.join(300)
    assert len(crowded) > 10, crowded
    # (before: the chunks came in bursts, up to 2.2 s apart on a 2-core machine)
    assert max(crowded) < max(alone) + 0.5, (max(alone), sorted(crowded)[-5:])


def test_metrics_count_a_stop_string_as_stopped_and_exact_as_exact(api_server, api_client):
    """A reply ended by a stop string was counted "cancelled"; a logprobs request to
    ":verified" runs on the exact model and set verified's decode speed."""
    before = metric(api_server, "unimax_requests_total", mode="bf16", outcome="stop")
    cancelled = metric(api_server, "unimax_requests_total", outcome="cancelled")
    reply = api_client.chat.completions.create(model=f"{MODEL}:bf16", messages=QUESTION,
                                               max_tokens=40, stop=[" "])
    assert reply.choices[0].finish_reason == "stop"
    assert metric(api_server, "unimax_requests_total", mode="bf16", outcome="stop") == before + 1
    assert metric(api_server, "unimax_requests_total", outcome="cancelled") == cancelled
    speed = metric(api_server, "unimax_decode_tokens_per_second", mode="verified")
    api_client.chat.completions.create(model=f"{MODEL}:verified", messages=QUESTION,
                                       max_tokens=8, logprobs=True)
    assert metric(api_server, "unimax_decode_tokens_per_second", mode="verified") == speed
    assert metric(api_server, "unimax_decode_tokens_per_second", mode="exact") > 0
