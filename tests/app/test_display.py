"""The chat's display text (ui/display.py): exactly invertible, and rendered by a CommonMark
renderer we did not write (markdown-it-py, HTML on, as the page's renderer has it) it shows no
HTML from the text and doctest lines as code, not quotes."""

import markdown_it
from hypothesis import given, settings
from hypothesis import strategies as st

from ui.display import Chatbot, raw, shown

MD = markdown_it.MarkdownIt("commonmark", {"html": True})
PIECES = ["<", ">", "&", "`", "```", "~~~", "```pycon", ">>> ", "... ", "\n", " ", "b>",
          "img src=x>", "lt;", "amp;", "#60;", "pycon", "x", "é", "\n\n", "    ", "!--"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=30).map("".join))
def test_raw_gives_back_every_text(text):
    assert raw(shown(text)) == text


def test_html_in_text_shows_as_text():
    for text in ("<b>bold</b> and <img src=x onerror=alert(1)>", "a <!-- c --> b",
                 "x\n<div>\nblock\n</div>"):
        html = MD.render(shown(text))
        assert "<b>" not in html and "<img" not in html and "<div>" not in html
        assert "<!--" not in html
    assert MD.render(shown("1 < 2 & 3 > 2")) == MD.render("1 < 2 & 3 > 2")  # unchanged
    assert "&amp;lt;" in MD.render(shown("the entity &lt; as typed"))


def test_code_keeps_its_html_as_typed():
    text = "```html\n<b>x</b> &lt;\n```\nand `<i>` inline"
    assert shown(text) == text
    assert "&lt;b&gt;x&lt;/b&gt; &amp;lt;" in MD.render(shown(text))


def test_doctest_lines_are_code_not_quotes():
    text = "Example:\n\n>>> import os\n>>> os.getcwd()\n'/home'\n\nThat is all."
    html = MD.render(shown(text))
    assert "<blockquote>" not in MD.render(shown(text)) and "<blockquote>" in MD.render(text)
    assert '<code class="language-pycon">&gt;&gt;&gt; import os\n&gt;&gt;&gt; os.getcwd()\n' \
           "'/home'\n</code>" in html
    assert "<p>That is all.</p>" in html


def test_the_component_shows_and_hands_back():
    bot = Chatbot()
    message = {"role": "user", "content": "<b>hi</b>\n>>> 1 + 1\n2"}
    data = bot.postprocess([message])
    text = data.root[0].content[0].text
    assert text == shown(message["content"]) and "&lt;b>" in text
    back = bot.preprocess(data)
    assert back[0]["content"][0]["text"] == message["content"]
    assert bot.get_block_name() == "chatbot"


def test_a_rebuilt_component_still_shows_and_hands_back():
    """Gradio rebuilds a component from its class when an update changes its settings (a
    wrapped instance lost its display there)."""
    bot = Chatbot(height=300)
    again = type(bot)(**{**bot.recover_kwargs(bot.get_config()), "height": 200})
    assert "&lt;b>" in again.postprocess([{"role": "user", "content": "<b>x</b>"}]) \
        .root[0].content[0].text
