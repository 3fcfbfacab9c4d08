"""A real browser (Debian's headless Chromium driven by Playwright) against the real app: send a
message and watch it stream and the panels fill, Stop mid-reply, run an A/B comparison.
Set UNIMAX_SCREENSHOTS=docs to refresh the README's screenshots in docs/."""

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from app_server import running_app

from helpers import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="needs Debian's chromium (apt-get install chromium)")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def playwright():
    """One Playwright per module: its sync API cannot be started twice in a thread."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def page(playwright, tmp_path_factory):
    preset = tmp_path_factory.mktemp("preset") / "long.yaml"
    preset.write_text((ROOT / "presets" / "tiny-random.yaml").read_text()
                      .replace("max_new_tokens: 64", "max_new_tokens: 1500"))
    with running_app("--preset", str(preset)) as url:
        browser, page = open_page(playwright, url)
        yield page
        browser.close()


def open_page(p, url):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 950})
    page.console_messages = []
    page.on("console", lambda message: page.console_messages.append(message.text))
    page.goto(url)
    page.wait_for_selector("#message textarea", timeout=60_000)
    return browser, page


def shots_dir(tmp_path) -> Path:
    if os.environ.get("UNIMAX_SCREENSHOTS") == "docs":
        (ROOT / "docs").mkdir(exist_ok=True)
        return ROOT / "docs"
    return tmp_path


def bot_text(page) -> str:
    bots = page.locator("#chatbot [data-testid='bot']")
    return bots.last.inner_text() if bots.count() else ""


def wait_for(predicate, timeout=30.0, step=0.05, show=None):
    """``predicate``'s first true value within ``timeout`` seconds; ``show``: what to report
    of the page if none comes (a flaky wait is diagnosable only from what it last saw)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"condition not met in {timeout} s"
                         + (f"; the page showed: {show()!r}" if show else ""))


def status_of(page):
    """For wait_for's report: the status line and the chat's message count."""
    return lambda: (page.inner_text("#status"),
                    page.locator("#chatbot [data-testid='user']").count())


def cancelled_count(url) -> float:
    """Requests the engine ended as cancelled, from the app's Prometheus metrics."""
    import httpx

    for line in httpx.get(url + "metrics", timeout=30).text.splitlines():
        if line.startswith("unimax_requests_total") and 'outcome="cancelled"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def send(page, text):
    page.fill("#message textarea", text)
    page.click("#send")


def test_chat_streams_panels_fill_and_stop_works(page, tmp_path):
    send(page, "Hello UNI MAX")
    first = wait_for(lambda: len(bot_text(page)) > 0 and len(bot_text(page)))
    grown = wait_for(lambda: len(bot_text(page)) > first + 5 and len(bot_text(page)))
    assert grown > first  # the reply streams in
    wait_for(lambda: "tokens prefilled this turn" in page.inner_text("#panel")
             and "tok/s" in page.inner_text("#panel"))
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status") or "cancelled" in
             page.inner_text("#status"))
    time.sleep(0.5)
    length = len(bot_text(page))
    time.sleep(1.5)
    assert len(bot_text(page)) == length  # nothing more arrives after Stop
    assert 0 < length < 1500  # stopped mid-reply, and the partial reply stays on the page
    assert page.locator("text=Error").count() == 0
    panel = wait_for(lambda: "tok/s" in page.inner_text("#panel").split("prefill")[1]
                     .split("\n")[0] and page.inner_text("#panel"))
    assert "bridge size" in panel and "MiB" in panel  # final stats shown after the Stop
    page.screenshot(path=str(tmp_path / "stopped.png"))


def test_ab_comparison(page, tmp_path):
    """Both replies race side by side (they ran one after the other), each with its own
    stats; the chat's mode and panels leave the tab."""
    page.get_by_role("tab", name="A/B").click()
    wait_for(lambda: not page.locator("#panels").is_visible()
             and not page.locator("#mode").is_visible())
    page.fill("#ab-prompt textarea", "Compare me")
    page.press("#ab-prompt textarea", "Enter")  # Enter compares, as the button does
    # both sides grow while the other is still running
    wait_for(lambda: "Racing" in page.inner_text("#ab-status")
             and len(page.inner_text("#ab-a")) > 20 and len(page.inner_text("#ab-b")) > 20,
             show=lambda: page.inner_text("#ab-status"))
    assert "tok/s" in page.inner_text("#ab-stats-a") + page.inner_text("#ab-stats-b")
    summary = wait_for(lambda: ("identical" in page.inner_text("#ab-status") or "diverge" in
                                page.inner_text("#ab-status")) and page.inner_text("#ab-status"),
                       timeout=120)
    assert "speed of" in summary or "Speed ratio" in summary
    ratio = re.search(r"fp8 decodes at ([0-9.]+)x", summary)
    if ratio and float(ratio.group(1)) < 1:  # (on this CPU: FP8 emulated, ~0.6x)
        assert "On the CPU FP8 is emulated" in summary, summary  # the verdict says why
    assert page.inner_text("#ab-a").strip() and page.inner_text("#ab-b").strip()
    assert "decode" in page.inner_text("#ab-stats-a") and "decode" in \
        page.inner_text("#ab-stats-b")
    page.set_viewport_size({"width": 1024, "height": 900})  # side by side from ~1000 px
    time.sleep(0.5)
    a, b = page.locator("#ab-a").bounding_box(), page.locator("#ab-b").bounding_box()
    assert abs(a["y"] - b["y"]) < 5 and b["x"] > a["x"] + a["width"] - 5, (a, b)
    page.set_viewport_size({"width": 1400, "height": 950})
    # the tiny model's template has no thinking switch: no checkbox for it
    assert page.get_by_label("Thinking").count() == 0
    page.get_by_role("tab", name="Chat").click()
    wait_for(lambda: page.locator("#panels").is_visible() and page.locator("#mode").is_visible())


def test_clear_during_a_streaming_reply_wins(page):
    """Clear mid-reply empties the chat for good, and the next message starts a new
    conversation from nothing (no old tokens prefilled or reused)."""
    page.get_by_role("tab", name="Chat").click()
    send(page, "Tell me a long story")
    wait_for(lambda: len(bot_text(page)) > 10)
    page.click("#clear")
    wait_for(lambda: page.locator("#chatbot [data-testid='bot']").count() == 0)
    cleared_for_good(page)


def cleared_for_good(page):
    """After a Clear mid-reply: the chat stays empty and says so, and the next message starts
    a new conversation from nothing (no old tokens prefilled or reused)."""
    time.sleep(1.5)  # late updates of the cancelled reply must not bring it back
    assert page.locator("#chatbot [data-testid='bot']").count() == 0
    assert page.locator("#chatbot [data-testid='user']").count() == 0
    assert "Cleared" in page.inner_text("#status")
    # nor its last stats the panels (the cancelled reply's final ones came after Clear's)
    assert "No reply yet" in page.inner_text("#panel"), page.inner_text("#panel")
    send(page, "Hi")
    wait_for(lambda: len(bot_text(page)) > 0)
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status"))
    assert page.locator("#chatbot [data-testid='user']").count() == 1
    wait_for(lambda: re.search(r"tokens reused from kept state\s+0\b",
                               page.inner_text("#panel")))


def test_examples_send_and_the_chats_trash_icon_clears(page):
    """The preset's examples sit on the empty chat and one click sends one; the chat's own
    trash icon mid-reply is a Clear (before, it emptied the page only until the streaming
    reply's next update brought the turn back); no share-to-Hugging-Face button."""
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    examples = page.locator("#chatbot button.example")
    wait_for(lambda: examples.count() == 2, show=status_of(page))
    assert examples.nth(1).inner_text() == "Tell me a story"
    examples.nth(1).click()
    wait_for(lambda: len(bot_text(page)) > 10, show=status_of(page))
    assert page.locator("#chatbot [data-testid='user']").inner_text() == "Tell me a story"
    assert page.locator("#chatbot button[aria-label='Share']").count() == 0
    page.locator("#chatbot button[aria-label='Clear']").click()
    wait_for(lambda: "Cleared" in page.inner_text("#status"), show=status_of(page))
    assert examples.count() == 2  # the empty chat offers them again
    cleared_for_good(page)


def test_refused_message_goes_back_to_the_box(page):
    """A message over the context is refused, leaves the chat, returns to the box, and the
    conversation goes on."""
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    wait_for(lambda: page.locator("#chatbot [data-testid='user']").count() == 0 and
             "Cleared" in page.inner_text("#status"), show=status_of(page))
    huge = "x " * 3000  # over the tiny preset's 2048-token context
    send(page, huge)
    wait_for(lambda: "context" in page.inner_text("#status"), timeout=60, show=status_of(page))
    assert page.locator("#chatbot [data-testid='user']").count() == 0
    assert page.input_value("#message textarea") == huge
    send(page, "Short")
    wait_for(lambda: len(bot_text(page)) > 0)
    page.click("#stop")
    assert page.locator("#chatbot [data-testid='user']").count() == 1


def test_closing_the_tab_cancels_the_reply(page):
    """A tab that goes away mid-reply stops the GPU work (the service reports 'cancelled')."""
    from gradio_client import Client

    url = page.url
    context = page.context.browser.new_context()
    other = context.new_page()
    other.goto(url)
    other.wait_for_selector("#message textarea", timeout=60_000)
    other.fill("#message textarea", "A long answer please")
    other.click("#send")
    wait_for(lambda: len(other.locator("#chatbot [data-testid='bot']").last.inner_text()) > 0
             if other.locator("#chatbot [data-testid='bot']").count() else False)
    before = cancelled_count(url)
    context.close()
    wait_for(lambda: cancelled_count(url) > before, timeout=30)
    # /stats is per client: a stranger sees none of that tab's figures or ids
    assert Client(url, verbose=False).predict(api_name="/stats") == {"mode": None}


def test_regenerate_export_and_queue_position(page, tmp_path):
    """Regenerate replaces the last reply (greedy: the same text again); Export gives a JSON
    file of the conversation; a second tab waits its turn and says so."""
    page.get_by_role("tab", name="Chat").click()
    assert not page.locator("#export-file").is_visible()  # no empty file box before Export
    page.click("#clear")
    wait_for(lambda: page.locator("#chatbot [data-testid='bot']").count() == 0)
    # a second tab starts a long reply first, so this tab has to wait
    context = page.context.browser.new_context()
    other = context.new_page()
    other.goto(page.url)
    other.wait_for_selector("#message textarea", timeout=60_000)
    other.fill("#message textarea", "Take your time")
    other.click("#send")
    wait_for(lambda: other.locator("#chatbot [data-testid='bot']").count() > 0)
    send(page, "Short question")
    wait_for(lambda: "Waiting for the engine" in page.inner_text("#status"), timeout=30)
    context.close()  # the other reply is cancelled; ours runs
    wait_for(lambda: "Done" in page.inner_text("#status"), timeout=120)
    first = bot_text(page)
    page.click("#regenerate")
    wait_for(lambda: "Done" not in page.inner_text("#status"))  # the new reply has started
    wait_for(lambda: "Done" in page.inner_text("#status"), timeout=120)
    assert page.locator("#chatbot [data-testid='bot']").count() == 1
    assert bot_text(page) == first
    with page.expect_download(timeout=30_000) as download:  # one click (it took two)
        page.click("#export")
    path = download.value.path()
    data = __import__("json").loads(Path(path).read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "Short question"
    page.click("#clear")
    wait_for(lambda: not page.locator("#export-file").is_visible())


def test_demo_model_answers_in_the_browser(playwright, tmp_path):
    """The app on its default preset, the shipped demo model: stdlib questions, the first one
    of its examples, get their documented answers in the page (the README's screenshot)."""
    with running_app() as url:
        browser, page = open_page(playwright, url)
        for turn, (question, expected) in enumerate((("What does json.dumps do?", "JSON"),
                                                     ("What is the csv module for?", "CSV"))):
            if turn == 0:  # the first is one of the preset's examples, clicked
                page.locator("#chatbot button.example", has_text=question).click()
            else:
                send(page, question)
            wait_for(lambda turn=turn: page.locator("#chatbot [data-testid='bot']").count()
                     == turn + 1, timeout=60)
            wait_for(lambda expected=expected: expected in bot_text(page)
                     and "Done" in page.inner_text("#status"), timeout=120)
        wait_for(lambda: "tok/s" in page.inner_text("#panel")
                 and page.locator("#plot svg polyline").count() == 1)
        page.screenshot(path=str(shots_dir(tmp_path) / "chat.png"))
        # the tok/s curve is drawn, and the page logs no warnings (the chart library Gradio's
        # plot used warned about its spec version on every page)
        assert not page.console_messages, page.console_messages
        page.get_by_role("tab", name="A/B").click()  # the README's A/B picture, demo model
        page.fill("#ab-prompt textarea", "What does json.loads do?")
        page.click("#ab-run")
        wait_for(lambda: "identical" in page.inner_text("#ab-status") or "diverge" in
                 page.inner_text("#ab-status"), timeout=120)
        time.sleep(1)  # let the panel timer catch up before the picture
        page.screenshot(path=str(shots_dir(tmp_path) / "ab.png"))
        browser.close()


def test_thinking_folds_away_above_the_answer(playwright, tmp_path):
    """A Qwen3.5-style template with the Thinking box ticked: the reply's thinking block
    shows as a folded "Thinking" message and the answer below it (the demo model with a piece
    of its reply renamed "</think>", as in test_reasoning.py: here "Traceback", the one piece of
    its first 200 tokens after a long run of doctest lines)."""
    from test_reasoning import reference_reply

    from helpers import thinking_demo_model

    folder = thinking_demo_model(tmp_path / "thinking-model", {"Traceback": "</think>"})
    reasoning, answer = reference_reply(folder, 200).split("</think>")
    with running_app("--model", str(folder)) as url:
        browser, page = open_page(playwright, url)
        page.get_by_text("Generation").click()
        page.get_by_label("Thinking").check()
        send(page, "What does json.dumps do?")
        wait_for(lambda: "Done" in page.inner_text("#status"), timeout=120,
                 show=status_of(page))
        fold = page.locator("#chatbot .thought-group")
        # (the page folds the block at its last render, which may follow the status's "Done"
        # on a busy machine)
        wait_for(lambda: fold.count() == 1 and fold.inner_text().strip() == "Thinking",
                 timeout=30, show=lambda: fold.all_inner_texts())
        assert page.locator("#chatbot [data-testid='bot']").count() == 2  # the fold, the answer
        # (both are doctest text: the chat renders ">>>" as quote marks, not as text)
        def seen(text):
            return " ".join(text.replace(">>>", "").split())

        shown = seen(bot_text(page))
        assert shown == seen(answer), (shown, answer)
        assert seen(reasoning) not in seen(page.inner_text("#chatbot"))  # folded away
        fold.locator(".title").click()  # unfolds
        wait_for(lambda: seen(reasoning) in seen(page.inner_text("#chatbot")))
        browser.close()


def test_min_p_slider_reaches_the_sampler(page):
    """Min-p 1 keeps only the likeliest token: an A/B at temperature 2 then shows the greedy
    texts (temperature 0), and at min-p 0 it does not. (The penalty sliders: the tiny random
    model repeats one token whatever they say; their values reaching the request are
    test_page_logic.py's, their effect test_penalties.py's and test_openai_api.py's.)"""
    def compare(temperature, min_p) -> tuple[str, str]:
        for elem, value in (("#temperature", temperature), ("#min-p", min_p)):
            box = page.locator(f"{elem} input[type=number]")
            box.fill(str(value))
            box.press("Enter")
        page.fill("#ab-prompt textarea", "What does json.loads do?")
        page.click("#ab-run")
        status = lambda: page.inner_text("#ab-status")  # noqa: E731
        wait_for(lambda: "Racing" in status(), timeout=60, show=status)
        wait_for(lambda: "Racing" not in status(), timeout=120, show=status)
        time.sleep(0.5)  # (the update's components land one by one: the texts after the status)
        return page.inner_text("#ab-a"), page.inner_text("#ab-b")

    page.get_by_role("tab", name="A/B").click()
    if not page.locator("#min-p").is_visible():
        page.get_by_text("Generation").click()  # (the accordion starts closed)
    greedy = compare(0, 0)
    assert compare(2, 1) == greedy
    assert compare(2, 0) != greedy
    compare(0, 0)  # (the module's later tests find the settings as they were)


def test_seed_starts_empty_and_a_message_sent_mid_reply_is_refused_alike(page):
    """The seed box showed 0 (and sent it: Regenerate repeated itself); while a reply
    streamed, Enter was swallowed and Send cut the reply off unmarked. Now both say why they
    wait, the message stays in the box and the reply goes on."""
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    wait_for(lambda: "Cleared" in page.inner_text("#status"))
    page.get_by_text("Generation").click()  # the settings' accordion
    assert page.locator("#seed textarea, #seed input").first.input_value() == ""
    page.get_by_text("Generation").click()
    send(page, "Tell me a long story")
    wait_for(lambda: len(bot_text(page)) > 10)
    for how in ("Enter", "Send"):
        page.fill("#message textarea", f"Another question by {how}")
        if how == "Enter":
            page.press("#message textarea", "Enter")
        else:
            page.click("#send")
        wait_for(lambda: "still streaming" in page.inner_text("#status"), show=status_of(page))
        assert page.input_value("#message textarea") == f"Another question by {how}"
        assert page.locator("#chatbot [data-testid='user']").count() == 1
        length = len(bot_text(page))
        wait_for(lambda n=length: len(bot_text(page)) > n + 5)  # the reply goes on
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status"))


def test_the_layout_follows_the_window(page):
    """The chat was ~390 px tall at any window height, and at 800 px wide the settings took
    45% of the width."""
    page.get_by_role("tab", name="Chat").click()
    heights = []
    for height in (700, 1200):
        page.set_viewport_size({"width": 1400, "height": height})
        time.sleep(0.5)
        heights.append(page.locator("#chatbot").bounding_box()["height"])
    assert heights[1] > heights[0] + 200, heights
    page.set_viewport_size({"width": 800, "height": 900})
    time.sleep(0.5)
    settings = page.locator("#mode").bounding_box()
    assert settings["width"] < 0.36 * 800, settings
    page.set_viewport_size({"width": 1400, "height": 950})


def upload(page, path):
    with page.expect_file_chooser() as chooser:
        page.click("#import-chat")
    chooser.value.set_files(str(path))


def open_past_chats(page, count: int):
    """The past-chats list opened with ``count`` chats in it: a chat is listed once its reply
    has ended and the page has kept it, which on a busy machine comes after the status says
    so, and a list opened before it keeps its old entries: closed and opened again."""
    options = page.locator("ul[role=listbox] li")

    def listed():
        page.click("#past-chats input")
        deadline = time.time() + 3  # (the open list renders a moment after the click)
        while time.time() < deadline:
            if options.count() == count:
                return True
            time.sleep(0.1)
        page.keyboard.press("Escape")
        time.sleep(0.3)
        return False

    wait_for(listed, timeout=60, show=lambda: options.all_inner_texts())
    return options


def test_chats_are_kept_across_reloads_listed_and_imported(page, tmp_path):
    """A reload lost the chat: now the chat comes back, earlier chats are listed and can be
    opened again, and an exported chat can be imported."""
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    wait_for(lambda: "Cleared" in page.inner_text("#status"))
    page.fill("#message textarea", "First chat question")
    page.press("#message textarea", "Enter")
    wait_for(lambda: len(bot_text(page)) > 0)
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status"))
    time.sleep(1)  # the chat is kept once its reply ends
    page.reload()
    page.wait_for_selector("#message textarea", timeout=60_000)
    wait_for(lambda: page.locator("#chatbot [data-testid='user']").count() == 1)
    assert page.locator("#chatbot [data-testid='user']").inner_text() == "First chat question"
    first_reply = bot_text(page)
    assert first_reply
    page.click("#new-chat")
    wait_for(lambda: page.locator("#chatbot [data-testid='user']").count() == 0)
    send(page, "Second chat question")
    wait_for(lambda: len(bot_text(page)) > 0)
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status"))
    options = open_past_chats(page, 2)
    assert "Second chat question" in options.nth(0).inner_text()
    options.nth(1).click()  # the first chat again
    wait_for(lambda: page.locator("#chatbot [data-testid='user']").count() == 1 and
             page.locator("#chatbot [data-testid='user']").inner_text() == "First chat question")
    assert bot_text(page) == first_reply
    exported = tmp_path / "chat.json"
    exported.write_text(__import__("json").dumps({"model": "x", "mode": "bf16", "system": "",
        "messages": [{"role": "user", "content": "Imported question"},
                     {"role": "assistant", "content": "Imported answer"}]}))
    upload(page, exported)
    wait_for(lambda: "Imported 2 messages" in page.inner_text("#status"), show=status_of(page))
    assert bot_text(page) == "Imported answer"
    open_past_chats(page, 3)
    page.keyboard.press("Escape")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    upload(page, bad)
    wait_for(lambda: "Not imported" in page.inner_text("#status"), show=status_of(page))
    page.click("#clear")  # Clear forgets the chat it empties
    wait_for(lambda: "Cleared" in page.inner_text("#status"))
    options = open_past_chats(page, 2)
    page.keyboard.press("Escape")


def test_html_in_a_message_shows_as_text_and_doctests_as_code(page):
    """User HTML rendered (<b> bold, <img> an image) and doctest lines as nested quotes; the
    message the app keeps and exports is still what was typed."""
    page.get_by_role("tab", name="Chat").click()
    page.click("#clear")
    wait_for(lambda: "Cleared" in page.inner_text("#status"))
    typed = "<b>bold</b> <img src=x>\n>>> 1 + 1\n2"
    send(page, typed)
    wait_for(lambda: len(bot_text(page)) > 5)
    page.click("#stop")
    wait_for(lambda: "Stopped" in page.inner_text("#status") or "Done" in
             page.inner_text("#status"))
    user = page.locator("#chatbot [data-testid='user']").last
    assert user.locator("b, img, blockquote").count() == 0
    assert "<b>bold</b> <img src=x>" in user.inner_text()
    assert ">>> 1 + 1\n2" in user.locator("code").last.inner_text()
    with page.expect_download(timeout=30_000) as download:
        page.click("#export")
    data = __import__("json").loads(Path(download.value.path()).read_text())
    assert data["messages"][0]["content"] == typed
