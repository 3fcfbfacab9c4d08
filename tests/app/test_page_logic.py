"""The page's pure pieces (issue 12): Stop after a finished reply, how a reply's end is worded,
the drafted-vs-generated note, Clear resetting the panels, Clear winning over a reply's last
update."""

import json
import threading

import gradio as gr
import pytest

from ui.chat_tab import ChatTab, Gen, done_status
from ui.panels import ab_summary, curve_svg, nice_ceiling, panel_markdown
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


class Event:
    def __init__(self, kind, text="", **data):
        self.kind, self.text, self.data = kind, text, data


class Service:
    """Replies with two deltas and a done event, like the engine thread's stream (after
    ``ahead``: events that come before them, such as "queued")."""

    def __init__(self, ahead=(), reply=True):
        self.ahead, self.reply = list(ahead), reply  # reply False: ``ahead`` alone

    def submit(self, conversation_id, messages, mode, settings):
        handle = Handle(finished=False)
        events = self.ahead + ([Event("delta", "Once"), Event("delta", " upon"),
                                Event("done", stopped="length")] if self.reply else [])

        def stream():
            yield from events
            handle.finished.set()

        handle.events = stream
        return handle


def test_the_min_p_and_penalty_sliders_reach_the_request():
    """The page's settings, min-p and the penalties among them, are the request's."""
    service = Service()
    seen = []
    submit = service.submit
    service.submit = lambda *args: seen.append(args[3]) or submit(*args)
    chat = ChatTab(service, Sessions(), preset=None)
    gen = Gen("c", "bf16", "", 0.9, 1.0, 0, 16, None, None, 0.25, 0.5, 1.2)
    list(chat.reply([{"role": "user", "content": "hi"}], gen, "s", sent="hi"))
    assert seen[0].min_p == 0.25 and seen[0].sampling().min_p == 0.25
    assert (seen[0].presence_penalty, seen[0].repetition_penalty) == (0.5, 1.2)
    plain = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, None).settings()
    assert plain.min_p == 0.0 and not plain.penalties().active


def test_clear_after_the_last_event_still_wins():
    """Clear between the stream's last event and the reply's end: the reply's last update is
    already on its way and may land after Clear's, so the reply ends on Clear's page."""
    sessions = Sessions()
    chat = ChatTab(Service(), sessions, preset=None)
    gen = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, None)
    reply = chat.reply([{"role": "user", "content": "hi"}], gen, "s", sent="hi")
    updates = []
    for update in reply:
        updates.append(update)
        if update[2].startswith("Done"):
            sessions.bump("s")  # what Clear does first (ChatTab.clear)
            sessions.cancel("s")
    assert updates[-2][0][-1]["content"] == "Once upon"
    assert updates[-1][0] == [] and updates[-1][2] == "Cleared."
    assert updates[-1][1] == gr.update()  # what the user typed since stays in the box


def test_a_streaming_reply_leaves_the_box_to_the_user():
    """The message box is emptied once, by the update that sends the message; the reply's
    later updates leave it alone, so the next message can be typed while this one streams.
    A refused message goes back into the box, once."""
    chat = ChatTab(Service([Event("queued", position=1, warming_up=None)]), Sessions(),
                   preset=None)
    gen = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, None)
    boxes = [u[1] for u in chat.reply([{"role": "user", "content": "hi"}], gen, "s",
                                      sent="hi")]
    assert len(boxes) == 5 and boxes[0] == ""
    assert all(box == gr.update() for box in boxes[1:]), boxes
    refusing = Service([Event("error", "over the context")], reply=False)
    chat = ChatTab(refusing, Sessions(), preset=None)
    updates = list(chat.reply([{"role": "user", "content": "hi"}], gen, "s", sent="hi"))
    assert [u[1] for u in updates] == ["", "hi"] and updates[1][0] == []


def test_a_reply_sent_during_the_warm_up_says_what_it_waits_for():
    """The app serves while it warms its modes up: a reply queued then says the engine is
    warming up which mode, not just a queue position; then it streams as usual."""
    service = Service([Event("queued", position=0, warming_up="verified"),
                       Event("queued", position=1, warming_up="verified"),
                       Event("queued", position=1, warming_up=None)])
    chat = ChatTab(service, Sessions(), preset=None)
    gen = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, None)
    statuses = [u[2] for u in chat.reply([{"role": "user", "content": "hi"}], gen, "s",
                                         sent="hi")]
    assert "warming up the verified mode" in statuses[1] == statuses[2]
    assert statuses[3] == "⏳ Waiting for the engine: 1 request(s) ahead."
    assert statuses[-1].startswith("Done")


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
    assert "| drafts per block | 0.0 |" in text
    bf16 = {"mode": "bf16", "prefilled_tokens": 5, "generated_tokens": 12,
            "acceptance_rate": None}
    assert "verified mode only" in panel_markdown(bf16)


def test_curve_svg_axes_start_at_zero_and_end_round():
    """A one-block reply (issue: "0000" / "8.000000" labels on the old plot) and a longer one:
    axes from 0 to a round number, the last point where the reply's rate is."""
    assert curve_svg({}) == "" and curve_svg(None) == ""
    one = curve_svg({"decode_curve": [[8, 123.456]]})
    labels = [part.split("<")[0] for part in one.split("'>")[1:] if part[:1].isdigit()]
    assert labels == ["0", "100", "200", "0", "5", "10"], labels  # y: 123.5 x 1.1 -> 200
    many = curve_svg({"decode_curve": [[8, 90.0], [16, 101.0], [22, 99.5]]}, width=320,
                     height=170)
    points = many.split("points='")[1].split("'")[0].split()
    xs = [float(p.split(",")[0]) for p in points]
    assert xs == sorted(xs) and len(xs) == 3
    # x axis 0..25: the last point (22 tokens) at 22/25 of the plot's width from its left edge
    assert abs(xs[-1] - (44 + 266 * 22 / 25)) < 0.1
    assert [nice_ceiling(v) for v in (0.3, 1, 7, 12, 22, 240, 1000.5)] == \
        [0.5, 1, 10, 20, 25, 250, 2000]


def test_ab_summary_when_sampling_speaks_of_distributions():
    fast = {"decode_tok_s": 100.0}
    same = ab_summary("bf16", "abc", fast, "verified", "abd", fast, temperature=0.7)
    assert "Same distribution." in same and "diverge" not in same
    other = ab_summary("bf16", "abc", fast, "fp8", "abd", fast, temperature=0.7)
    assert "Not the same distribution." in other
    greedy = ab_summary("bf16", "abc", fast, "verified", "abd", fast)
    assert "first diverge at character 2" in greedy


def test_ab_summary_says_why_an_fp8_mode_was_slower():
    """Where fp8 or verified mode decodes slower than BF16-only, the verdict says why from the
    slower side's own stats (the device, whether it drafted, its acceptance); nothing where it
    was faster or where neither side is BF16-only."""
    bf16 = {"decode_tok_s": 100.0, "device": "cuda:0"}
    cpu = ab_summary("bf16", "a", {**bf16, "device": "cpu"}, "verified", "a",
                     {"decode_tok_s": 60.0, "device": "cpu", "drafted_tokens": 40,
                      "acceptance_rate": 0.9})
    assert "0.60x" in cpu and "On the CPU FP8 is emulated" in cpu and "verified mode" in cpu
    drafted = ab_summary("verified", "a", {"decode_tok_s": 80.0, "device": "cuda:0",
                                          "drafted_tokens": 40, "acceptance_rate": 0.55},
                         "bf16", "a", bf16)
    assert "at this reply's acceptance (55%)" in drafted, drafted
    idle = ab_summary("bf16", "a", bf16, "verified", "a",
                      {"decode_tok_s": 97.0, "device": "cuda:0", "drafted_tokens": 0,
                       "acceptance_rate": None})
    assert "drafted nothing" in idle
    tail = ab_summary("bf16", "a", bf16, "fp8", "a", {"decode_tok_s": 90.0, "device": "cuda"})
    assert "kernel launches" in tail and "LM head" in tail
    faster = ab_summary("bf16", "a", bf16, "verified", "a",
                        {"decode_tok_s": 130.0, "device": "cuda:0", "drafted_tokens": 40})
    neither = ab_summary("fp8", "a", {"decode_tok_s": 100.0, "device": "cpu"}, "verified", "a",
                         {"decode_tok_s": 50.0, "device": "cpu"})
    for text in (faster, neither):
        assert text.endswith("**identical**."), text


def test_a_thinking_block_folds_away_above_the_answer():
    """A reply that starts inside a thinking block (the prompt opened it: "started" says so)
    shows its reasoning as a folded "Thinking" message, pending until the block closes, then
    the answer; the next turn sends the model the answer alone, and Export marks the fold."""
    events = [Event("started", prefill_tokens=3, reused_tokens=0, thinking_open=True),
              Event("delta", "Let me see."), Event("delta", "</th"),
              Event("delta", "ink>\n\nIt is"), Event("delta", " 4."),
              Event("done", stopped="stop")]

    class Thinking(Service):
        def submit(self, conversation_id, messages, mode, settings):
            self.sent = messages
            handle = Handle(finished=True)
            handle.events = lambda: iter(events)
            return handle

    from unimax.presets import Preset

    service = Thinking()
    chat = ChatTab(service, Sessions(), preset=Preset(model="tiny-random"))
    gen = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, True)
    updates = list(chat.reply([{"role": "user", "content": "2+2?"}], gen, "s", sent="2+2?"))
    thinking = {"title": "Thinking", "status": "pending"}
    assert updates[2][0][1:] == [
        {"role": "assistant", "content": "Let me see.", "metadata": thinking},
        {"role": "assistant", "content": ""}]  # "</th" held back: it may close the block
    final = updates[-1][0]
    assert final == [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "Let me see.",
                      "metadata": {**thinking, "status": "done"}},
                     {"role": "assistant", "content": "It is 4."}]
    assert updates[-1][2].startswith("Done")
    list(chat.reply(final + [{"role": "user", "content": "And 3+3?"}], gen, "s"))
    assert service.sent == [{"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "It is 4."},
                            {"role": "user", "content": "And 3+3?"}]
    exported = __import__("json").loads(open(chat.export(final, "", "bf16")["value"]).read())
    assert [m.get("thinking", False) for m in exported["messages"]] == [False, True, False]


def test_the_status_leaves_prefilling_once_tokens_stream():
    """It said "prefilling..." until the reply was done."""
    service = Service([Event("started", prefill_tokens=3, reused_tokens=0)])
    chat = ChatTab(service, Sessions(), preset=None)
    gen = Gen("c", "fp8", "", 0.0, 1.0, 0, 16, None, None)
    statuses = [u[2] for u in chat.reply([{"role": "user", "content": "hi"}], gen, "s",
                                         sent="hi")]
    assert "prefilling" in statuses[1]
    assert statuses[2] == statuses[3] == "Generating (fp8)…"  # the two deltas'
    assert statuses[-1].startswith("Done")


def test_a_message_refused_mid_reply_stays_said_until_the_reply_ends():
    """A message sent while a reply streamed said so for one update: the reply's next delta
    put "Generating" back at once. Now the reply's status keeps the notice to its end."""
    sessions = Sessions()
    chat = ChatTab(Service(), sessions, preset=None)
    gen = Gen("c", "bf16", "", 0.0, 1.0, 0, 16, None, None)
    request = type("Request", (), {"session_hash": "s"})()
    replying = chat.reply([{"role": "user", "content": "hi"}], gen, "s", sent="hi")
    next(replying)  # the message leaves the box; the reply is submitted with its first event
    statuses = [next(replying)[2]]
    refused = list(chat.send("again", [], "c", "bf16", "", 0.0, 1.0, 0, 16, "", None, 0.0,
                             0.0, 1.0, request))
    assert "still streaming" in refused[0][2] and refused[0][1] == "again"
    statuses += [u[2] for u in replying]
    assert "still streaming" in statuses[1] and statuses[-1].startswith("Done"), statuses
    # the next reply starts without it
    again = [u[2] for u in chat.reply([{"role": "user", "content": "hi"}], gen, "s")]
    assert not any("still streaming" in status for status in again), again


def test_kept_chats_survive_what_a_browser_may_hold(tmp_path):
    """ui/chats.py: the stored value is read defensively, kept newest first and bounded, and an
    import takes only an exported chat."""
    from ui import chats

    assert chats.normalized("junk") == {"current": None, "chats": []}
    store = None
    for n in range(chats.MAX_CHATS + 3):
        store = chats.saved(store, f"id{n}", [{"role": "user", "content": [
            {"type": "text", "text": f"question {n} " + "x" * 80}]}])
    assert len(store["chats"]) == chats.MAX_CHATS and store["chats"][0]["id"] == f"id{n}"
    assert store["chats"][0]["title"].startswith(f"question {n} ")
    assert len(store["chats"][0]["title"]) == chats.MAX_TITLE
    assert store["chats"][0]["messages"][0]["content"].startswith(f"question {n}")
    assert chats.find(chats.removed(store, f"id{n}"), f"id{n}") is None
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "hmm", "thinking": True},
        {"role": "assistant", "content": "Hello"}]}))
    messages, system = chats.imported(good)
    assert system == "Be brief." and messages[1]["metadata"]["title"] == "Thinking"
    for text in ("[1]", "{}", '{"messages": [{"role": "wizard", "content": "x"}]}', "\xff"):
        bad = tmp_path / "bad.json"
        bad.write_text(text, encoding="latin-1")
        with pytest.raises(chats.NotAChat):
            chats.imported(bad)


def test_the_panels_show_the_start_up_while_it_runs():
    from ui.panels import warm_up_line

    state = {"running": "bf16", "ready": ["fp8"], "pending": ["verified"], "error": None,
             "seconds": {"fp8": 41.6}, "tuning": 0}
    assert warm_up_line(state) == \
        "_Start-up: fp8 ready (42 s) · bf16 warming up · verified waiting._\n\n"
    done = {**state, "running": None, "ready": ["fp8", "bf16", "verified"], "pending": []}
    assert warm_up_line({**done, "tuning": 12}).startswith(
        "_Start-up: every mode ready; timing 12 kernel choices")
    assert warm_up_line(done) == ""
    assert warm_up_line({"running": None, "ready": [], "pending": [], "error": None}) == ""
