"""The page's pure pieces (issue 12): Stop after a finished reply, how a reply's end is worded,
the drafted-vs-generated note, Clear resetting the panels."""

import threading

from ui.chat_tab import done_status
from ui.panels import panel_markdown
from ui.sessions import Sessions


class Handle:
    def __init__(self, finished):
        self.finished, self.cancelled = threading.Event(), False
        if finished:
            self.finished.set()

    def cancel(self):
        self.cancelled = True


def test_stop_after_a_finished_reply_cancels_nothing():
    sessions = Sessions()
    done = Handle(finished=True)
    sessions.start("s", done)
    assert sessions.cancel("s") is False and not done.cancelled
    running = Handle(finished=False)
    sessions.start("s", running)
    assert sessions.cancel("s") is True and running.cancelled
    assert sessions.cancel("nobody") is False


def test_done_status_says_who_ended_the_reply():
    assert done_status("stop") == "Done: the model ended its turn."
    assert "max new tokens" in done_status("length")
    assert done_status("cancelled") == "Stopped."


def test_panels_explain_drafts_past_the_end_and_start_over_when_cleared():
    stats = {"prefilled_tokens": 5, "generated_tokens": 13, "drafted_tokens": 16,
             "accepted_draft_tokens": 16, "acceptance_rate": 1.0}
    assert "past the end of the reply" in panel_markdown(stats)
    assert "past the end" not in panel_markdown({**stats, "accepted_draft_tokens": 9})
    sessions = Sessions()
    sessions.set_stats("s", stats)
    sessions.set_stats("s", {})  # what Clear does
    assert panel_markdown(sessions.get_stats("s")).startswith("_No reply yet")


def test_thinking_checkbox_only_for_templates_with_the_switch():
    from ui.page import has_thinking_switch

    class Tok:
        def __init__(self, template):
            self.chat_template = template

    assert has_thinking_switch(Tok("{% if enable_thinking %}<think>{% endif %}"))
    assert not has_thinking_switch(Tok("{{ messages }}")) and not has_thinking_switch(Tok(None))


def test_panels_say_when_every_block_was_an_exact_step():
    """The draft-length policy may take exact steps only (poor drafts): no acceptance rate to
    show, and the panel says why rather than "verified mode only"."""
    stats = {"mode": "verified", "prefilled_tokens": 5, "generated_tokens": 12,
             "drafted_tokens": 0, "accepted_draft_tokens": 0, "acceptance_rate": None,
             "mean_draft_length": 0.0}
    text = panel_markdown(stats)
    assert "no drafts: every block was an exact step" in text
    assert "| drafts per block (chosen per block) | 0.0 |" in text
    bf16 = {"mode": "bf16", "prefilled_tokens": 5, "generated_tokens": 12,
            "acceptance_rate": None}
    assert "verified mode only" in panel_markdown(bf16)
