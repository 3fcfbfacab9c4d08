"""The reasoning splitter (unimax/reasoning.py) fed in pieces against a plain split of the whole
text, at every cut; a reply without a thinking block passes through unchanged."""

import random

import pytest

from helpers import reference_chat_reply
from unimax.reasoning import ThinkingEnd, ThinkSplitter, opens_thinking


def whole(text: str, opened: bool, ends: tuple[str, ...] = ()) -> tuple[str, str]:
    """The plain reference: the whole reply at once."""
    if not opened:
        start = text.lstrip()
        if not start.startswith("<think>"):
            return "", text
        text = start[len("<think>"):]
    close = text.find("</think>")
    for tag in ends:  # a tag that ends the block first starts the answer, tag and all
        at = text.find(tag)
        if at >= 0 and (close < 0 or at < close):
            return text[:at], text[at:]
    if close < 0:
        return text, ""
    reasoning, answer = text.split("</think>", 1)
    return reasoning, answer.lstrip("\n")


def streamed(pieces: list[str], opened: bool, ends: tuple[str, ...] = ()) -> tuple[str, str]:
    splitter, reasoning, answer = ThinkSplitter(opened, ends), "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.flush()
    return reasoning + r, answer + a


REPLIES = [
    ("The user asks about X.\nLet me think.\n</think>\n\nX is a letter.", True),
    ("short</think>answer with </think> inside and <think> too", True),
    ("never closed <thin", True),
    ("</think>\n\n\n", True),
    ("  <think>plan first</think>\n\nThen answer.", False),
    ("<think>unclosed", False),
    ("Plain answer <think>not a block</think> here.", False),
    ("  \n leading blanks, no block", False),
    ("<thinking> is not the tag", False),
    ("<", False),
    ("<th", True),
    ("", False),
]


@pytest.mark.parametrize("text,opened", REPLIES)
def test_every_cut_matches_the_whole_split(text, opened):
    expected = whole(text, opened)
    assert streamed([text], opened) == expected
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]], opened) == expected, i
        for j in range(i, len(text) + 1):
            assert streamed([text[:i], text[i:j], text[j:]], opened) == expected, (i, j)


def test_random_texts_and_pieces():
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "t", "h", "\n", " ", "a", "<th", "</thi", "x"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.5
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(pieces, opened) == whole(text, opened), (text, opened, pieces)


def test_a_tool_call_inside_the_block_ends_it():
    """Qwen3.5 may open a tool call while thinking, without </think> first (with tools, the
    API's splitter takes <tool_call> as the block's end too)."""
    ends = ("<tool_call>",)
    for text, opened in [("plan <tool_call>\n<function=f>", True),
                         ("a </think>\n\nb <tool_call>", True), ("<think>x<tool_call>y", False),
                         ("no call <tool_ca", True)]:
        expected = whole(text, opened, ends)
        for i in range(len(text) + 1):
            assert streamed([text[:i], text[i:]], opened, ends) == expected, (text, i)
    assert whole("plan <tool_call>x", True, ends) == ("plan ", "<tool_call>x")
    rng = random.Random(1)
    alphabet = ["</think>", "<tool_call>", "<tool", "</th", "<", "t", "\n", " ", "a"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        cut = rng.randint(0, len(text))
        assert streamed([text[:cut], text[cut:]], True, ends) == whole(text, True, ends), text


def test_no_block_passes_through_unchanged():
    for text in ("Hello", " Serialize ``obj``", "\n\nx", "a <think> b", "<b>bold</b>"):
        assert streamed(list(text), False) == ("", text)


@pytest.mark.parametrize("text", ["the os module is useful </think> {\"a\": 1}",
                                  "plain</think>{", "</think>  x", "no end here < /think>"])
def test_thinking_end_fires_at_the_token_that_completes_the_tag(text):
    """ThinkingEnd against the plain check on the whole decoded prefix: True at exactly the
    first token after which the reply's text holds </think> (the demo tokenizer spells the
    tag in several pieces)."""
    import unimax
    from helpers import ROOT

    tokenizer = unimax.load_tokenizer(str(ROOT / "models" / "unimax-demo"))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    watch = ThinkingEnd(tokenizer)
    fired = [i for i, token in enumerate(tokens) if watch(token)]
    want = [next(i for i in range(len(tokens))
                 if "</think>" in tokenizer.decode(tokens[:i + 1]))] if "</think>" in text else []
    assert len(tokens) > 3 and fired[:1] == want


def test_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")  # Qwen3.5, thinking on
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # off
    assert not opens_thinking("<|im_start|>assistant\n")
    assert not opens_thinking("")


# --- the app: a model whose chat template opens a thinking block (Qwen3.5's), over HTTP ------

QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]
# The demo model's reply to QUESTION behind an open <think> starts "\noll\n\n>>> read_..." and
# uses the piece "ll" there alone (in its first 200 tokens): renamed, the same reply closes the
# block there.
RENAMED = {"ll": "</think>"}


@pytest.fixture(scope="module")
def thinking_app(tmp_path_factory):
    from app_server import running_app

    from helpers import thinking_demo_model

    folder = thinking_demo_model(tmp_path_factory.mktemp("m") / "thinking-model", RENAMED)
    with running_app("--model", str(folder)) as url:
        yield url, folder


def reference_reply(folder, n: int, **switch) -> str:
    return reference_chat_reply(folder, QUESTION, n, **switch)[0]


def test_api_reports_the_thinking_block_as_reasoning_content(thinking_app):
    import openai

    url, folder = thinking_app
    text = reference_reply(folder, 24)
    assert text.count("</think>") == 1  # the renamed piece closes the block once
    reasoning, answer = text.split("</think>")
    answer = answer.lstrip("\n")  # (the blank lines after a block are not the answer's)
    api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
    args = dict(model="thinking-model:bf16", messages=QUESTION, max_tokens=24)
    message = api.chat.completions.create(**args).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.content == answer
    parts = {"reasoning_content": "", "content": ""}
    for chunk in api.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content",
                                                                        "")
    assert parts == {"reasoning_content": reasoning, "content": answer}
    # a stop string inside the reasoning ends the reply there, with no answer
    cut = api.chat.completions.create(**args, stop=["o"]).choices[0].message
    assert cut.model_extra["reasoning_content"] == reasoning.split("o")[0]
    assert cut.content == ""
    # thinking switched off: the template closes the block, the reply is all answer
    off = api.chat.completions.create(
        **args, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert off.choices[0].message.content == \
        reference_reply(folder, 24, enable_thinking=False)
