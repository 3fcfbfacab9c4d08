"""Log-probabilities over the OpenAI API, against the real app on its default preset (the demo
model): lm-eval's own API client (its loglikelihood tasks score context + continuation with
echo and logprobs, token ids in, as eval runs do), the ``openai`` client's chat logprobs and
completions echo, streamed and not, with stop strings; every figure checked against the demo
model's own full forward in this process."""

import httpx
import pytest
import torch

import unimax
from helpers import ROOT

MODEL = "unimax-demo"
DEMO = ROOT / "models" / "unimax-demo"
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]




@pytest.fixture(scope="module")
def demo():
    return unimax.load_model(DEMO, device="cpu"), unimax.load_tokenizer(DEMO)


def reference(demo, ids: list[int]) -> torch.Tensor:
    """Every position's log-probabilities, one forward without a cache."""
    model, _ = demo
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_lm_eval_loglikelihood_and_generation(api_server, demo):
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    lm = lm_eval.LocalCompletionsAPI(base_url=api_server + "v1/completions", model=MODEL,
                                     tokenizer=str(DEMO), tokenizer_backend="huggingface",
                                     max_retries=1)
    context, choices = "json.dumps(obj)", [" serializes obj", " deletes a file"]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(context, c), idx=i)
                for i, c in enumerate(choices)]
    results = lm.loglikelihood(requests)
    _, tokenizer = demo
    for (total, greedy), continuation in zip(results, choices, strict=True):
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        rows = reference(demo, whole)
        expected = sum(float(rows[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
        assert total == pytest.approx(expected, abs=1e-3)
        argmax = all(int(rows[i - 1].argmax()) == whole[i] for i in range(len(ctx), len(whole)))
        assert greedy == argmax
    assert results[0][0] > results[1][0]  # the docs' answer is the likelier one
    generated = lm.generate_until([Instance(
        request_type="generate_until", doc={}, idx=0,
        arguments=(context, {"until": ["\n"], "max_gen_toks": 16}))])
    direct = httpx.post(api_server + "v1/completions", timeout=60, json={
        "model": MODEL, "prompt": context, "max_tokens": 16, "temperature": 0,
        "stop": ["\n"]}).json()
    assert generated == [direct["choices"][0]["text"]] and generated[0]


def test_completions_echo_with_logprobs(api_client, demo):
    prompt = "json.dumps(obj) serializes"
    out = api_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True,
                                    logprobs=3, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert "".join(lp.tokens) == choice.text
    assert all(choice.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens,
                                                               strict=True))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _, tokenizer = demo
    ids = tokenizer(choice.text, add_special_tokens=False).input_ids
    assert len(lp.tokens) == len(ids) == out.usage.prompt_tokens + out.usage.completion_tokens
    rows = reference(demo, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[i - 1, ids[i]]), abs=1e-4)
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert len(top) <= 3 and top[0] == pytest.approx(float(rows[i - 1].max()), abs=1e-4)
    n = out.usage.prompt_tokens
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values())  # greedy reply
               for i in range(n, len(ids)))
    assert out.model_extra["unimax"]["mode"] == "exact"


def test_echo_without_logprobs_and_scoring_only(api_client):
    prompt = "json.dumps(obj) serializes"
    plain = api_client.completions.create(model=f"{MODEL}:bf16", prompt=prompt, max_tokens=6,
                                      temperature=0)
    echoed = api_client.completions.create(model=f"{MODEL}:bf16", prompt=prompt, max_tokens=6,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.model_extra["unimax"]["mode"] == "bf16"  # the engine served it
    scored = api_client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert len(scored.choices[0].logprobs.tokens) == scored.usage.prompt_tokens
    streamed = api_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True,
                                         logprobs=1, temperature=0, stream=True)
    pieces, tokens = [], []
    for chunk in streamed:
        pieces.append(chunk.choices[0].text)
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert "".join(pieces) == "".join(tokens) == prompt + plain.choices[0].text


@pytest.mark.parametrize("mode", ["bf16", "verified"])
def test_chat_logprobs_stream_equals_non_stream(api_client, demo, mode):
    args = dict(model=f"{MODEL}:{mode}", messages=QUESTION, max_tokens=16, temperature=0,
                logprobs=True, top_logprobs=2)
    reply = api_client.chat.completions.create(**args)
    text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert text and "".join(t.token for t in content) == text
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
        assert t.top_logprobs[1].logprob <= t.logprob
    engine = api_client.chat.completions.create(model=f"{MODEL}:{mode}", messages=QUESTION,
                                            max_tokens=16, temperature=0)
    assert engine.choices[0].message.content == text  # the exact model's greedy reply
    pieces, streamed = [], []
    for chunk in api_client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            streamed += choice.logprobs.content if choice.logprobs else []
    assert "".join(pieces) == text
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_chat_logprobs_with_a_stop_string(api_client):
    full = api_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                          logprobs=True).choices[0]
    word = next(w for w in full.message.content.split()[2:] if len(w) > 2)
    for stream in (False, True):
        args = dict(model=MODEL, messages=QUESTION, max_tokens=24, logprobs=True, stop=word,
                    stream=stream)
        if stream:
            text, tokens = "", []
            for chunk in api_client.chat.completions.create(**args):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    tokens += [t.token for t in (choice.logprobs.content if choice.logprobs
                                                 else [])]
        else:
            cut = api_client.chat.completions.create(**args).choices[0]
            text, tokens = cut.message.content, [t.token for t in cut.logprobs.content]
        assert text == full.message.content[:full.message.content.index(word)]
        # the tokens that the kept text starts in: the last may run into the stop string
        assert "".join(tokens).startswith(text)
        assert len("".join(tokens[:-1])) < len(text) <= len("".join(tokens))


@pytest.mark.parametrize("path,body,param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 99}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [5, 4096]}, None),
])
def test_bad_logprobs_requests_are_400s(api_server, path, body, param):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": QUESTION} if path == "chat" else {"prompt": "json.dumps"})
    r = httpx.post(api_server + f"v1/{'chat/completions' if path == 'chat' else 'completions'}",
                   json={**base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param
    if param is None:
        assert "outside this model's vocabulary" in error["message"]
