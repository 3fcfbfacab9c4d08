"""The Gradio page: chat with modes and settings, live panels, A/B comparison, and the stable API
endpoints /chat and /stats. Layout and wiring here; the handlers live in chat_tab.py, ab_tab.py
and script_api.py, and talk to the EngineService only; panels read stats snapshots and never
touch the GPU."""

from __future__ import annotations

import gradio as gr

from unimax.modes import APP_MODES
from unimax.presets import Preset
from unimax.service import EngineService

from . import chats, display
from .ab_tab import ABTab
from .chat_tab import ChatTab
from .panels import panel_markdown
from .script_api import add_script_api
from .sessions import Sessions

MODE_CHOICES = [(mode.label, mode.name) for mode in APP_MODES.values()]
CSS = """
#panels table { font-size: 0.9em; }
mark.ab-diverge { background: #ffd54f; }
pre.ab-text { white-space: pre-wrap; word-break: break-word; min-height: 3em; }
"""


# (the file box renders its link a moment after the update lands: look for it a while)
EXPORT_CLICK = """() => {
  let tries = 0;
  const look = () => {
    const link = document.querySelector('#export-file a[download]');
    if (link) link.click();
    else if (++tries < 50) setTimeout(look, 100);
  };
  look();
}"""


def has_thinking_switch(tokenizer) -> bool:
    """Whether the chat template reads the thinking switch (Qwen3.5's enable_thinking)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "enable_thinking" in template


def header(service: EngineService, preset: Preset) -> str:
    """The page's first line: the model, the preset and verified mode's draft."""
    return (f"**UNI MAX** · model `{preset.model}` on `{service.device}` · preset "
            f"`{preset.name}` · block {preset.block_size} · verified draft `{preset.draft}`")


def build_demo(service: EngineService, preset: Preset) -> gr.Blocks:
    sessions = Sessions()
    chat, ab = ChatTab(service, sessions, preset), ABTab(service, sessions)
    kept_chats = chats.KeptChats(sessions)
    g = preset.generation
    info = header(service, preset)

    # --- layout ----------------------------------------------------------------------------

    # delete_cache: Gradio's copies of served files (exports) older than 10 min go every 10 min.
    with gr.Blocks(title="UNI MAX", delete_cache=(600, 600)) as demo:
        gr.Markdown(info, elem_id="header")
        conversation_id = gr.State()  # the chat's id, set by demo.load below
        # the chats kept in this browser (ui/chats.py); the secret only scrambles them: the
        # browser keeps them for this server's origin alone, and a fixed one keeps them
        # readable across the app's restarts
        kept = gr.BrowserState(chats.normalized(None), storage_key="unimax-chats",
                               secret="unimax-local-chats")
        with gr.Row():
            with gr.Column(scale=2, min_width=240):
                mode = gr.Radio(MODE_CHOICES, value=preset.mode, label="Mode", elem_id="mode")
                system = gr.Textbox(preset.system_prompt, label="System prompt", lines=2)
                with gr.Accordion("Generation", open=False):
                    temperature = gr.Slider(0, 2, value=g.temperature, step=0.05,
                                            label="Temperature (0 = greedy)",
                                            elem_id="temperature")
                    top_p = gr.Slider(0.05, 1, value=g.top_p, step=0.05, label="Top-p")
                    top_k = gr.Slider(0, 200, value=g.top_k, step=1, label="Top-k (0 = off)")
                    min_p = gr.Slider(0, 1, value=g.min_p, step=0.01, label="Min-p (0 = off)",
                                      elem_id="min-p")
                    # (unimax.penalties: a penalized reply decodes one token at a time)
                    presence = gr.Slider(-2, 2, value=g.presence_penalty, step=0.1,
                                         label="Presence penalty (0 = off)", elem_id="presence")
                    repetition = gr.Slider(0.5, 2, value=g.repetition_penalty, step=0.05,
                                           label="Repetition penalty (1 = off)",
                                           elem_id="repetition")
                    max_new = gr.Slider(1, min(4096, preset.max_context),
                                        value=min(g.max_new_tokens, preset.max_context), step=1,
                                        label="Max new tokens")
                    # a text box: an empty number box showed 0 and sent 0, so Regenerate
                    # repeated itself
                    seed = gr.Textbox("" if g.seed is None else str(g.seed),
                                      label="Seed (empty = random)", placeholder="random",
                                      elem_id="seed")
                    thinking = gr.Checkbox(bool(preset.enable_thinking), label="Thinking",
                                           visible=has_thinking_switch(service.tokenizer))
            with gr.Column(scale=5, min_width=360):
                with gr.Tab("Chat", elem_id="chat-tab") as chat_tab:
                    with gr.Row(equal_height=True):
                        past = gr.Dropdown([], value=None, label="Chats kept in this browser",
                                           elem_id="past-chats", scale=4)
                        new_btn = gr.Button("New chat", elem_id="new-chat", scale=1)
                        import_btn = gr.UploadButton("Import JSON", file_types=[".json"],
                                                     elem_id="import-chat", scale=1)
                    # no share button: it posts to a Hugging Face Space, which a local
                    # app is not; the preset's examples sit on the empty chat
                    # (the window's height, not 420 px at any size)
                    # (display.Chatbot: no HTML from the text, doctest lines as code)
                    chatbot = display.Chatbot(height="62vh", min_height=300, label="Chat",
                                         editable="user",
                                         elem_id="chatbot", buttons=["copy", "copy_all"],
                                         examples=[{"text": text} for text in preset.examples]
                                         or None)
                    message = gr.Textbox(placeholder="Message (Enter to send)", show_label=False,
                                         elem_id="message")
                    with gr.Row():
                        send_btn = gr.Button("Send", variant="primary", elem_id="send")
                        stop_btn = gr.Button("Stop", elem_id="stop")
                        regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                        clear_btn = gr.Button("Clear", elem_id="clear")
                        export_btn = gr.Button("Export JSON", elem_id="export")
                    status = gr.Markdown("", elem_id="status")
                    # shown by Export, hidden by Clear: an empty file box under the chat
                    # reads as an upload field
                    export_file = gr.File(label="Exported conversation", visible=False,
                                          elem_id="export-file")
                with gr.Tab("A/B", elem_id="ab-tab") as ab_tab:
                    ab_prompt = gr.Textbox(label="Prompt", elem_id="ab-prompt",
                                           placeholder="A prompt for both modes (Enter to "
                                           "compare)")
                    with gr.Row():
                        mode_a = gr.Dropdown(MODE_CHOICES, value="bf16", label="Mode A",
                                             elem_id="ab-mode-a")
                        mode_b = gr.Dropdown(MODE_CHOICES, value="fp8", label="Mode B",
                                             elem_id="ab-mode-b")
                        ab_btn = gr.Button("Compare", variant="primary", elem_id="ab-run")
                        ab_stop = gr.Button("Stop", elem_id="ab-stop")
                    ab_status = gr.Markdown("", elem_id="ab-status")
                    with gr.Row():  # side by side from ~1000 px wide windows
                        with gr.Column(min_width=160):
                            gr.Markdown("**A**")
                            ab_text_a = gr.HTML(elem_id="ab-a")
                            ab_stats_a = gr.Markdown(elem_id="ab-stats-a")
                        with gr.Column(min_width=160):
                            gr.Markdown("**B**")
                            ab_text_b = gr.HTML(elem_id="ab-b")
                            ab_stats_b = gr.Markdown(elem_id="ab-stats-b")
            # the chat's panels (the A/B tab has a table per side, and hides these)
            with gr.Column(scale=3, min_width=240, elem_id="panels") as panels:
                gr.Markdown("### Live panels")
                panel = gr.Markdown(panel_markdown(None), elem_id="panel")
                plot = gr.HTML("", elem_id="plot")  # the tok/s curve (panels.curve_svg)

        gen_inputs = [conversation_id, mode, system, temperature, top_p, top_k, max_new, seed,
                      thinking, min_p, presence, repetition]
        chat_outputs = [chatbot, message, status]
        # Stop and Clear cancel through the service (the reply ends within one block and its
        # generator finishes normally), not through Gradio's cancels=, which can leave the
        # outputs showing an error.
        # The page's own events stay out of the API page (callable, undocumented): scripts use
        # /chat and /stats below, or the OpenAI API.
        page = dict(api_visibility="undocumented")
        # Send and Enter "multiple": a message sent while a reply streams reaches chat.send,
        # which says so (the default "once" dropped Enter silently in the page)
        replies = [
            send_btn.click(chat.send, [message, chatbot, *gen_inputs], chat_outputs,
                           concurrency_limit=None, trigger_mode="multiple", **page),
            message.submit(chat.send, [message, chatbot, *gen_inputs], chat_outputs,
                           concurrency_limit=None, trigger_mode="multiple", **page),
            regen_btn.click(chat.regenerate, [chatbot, *gen_inputs], chat_outputs,
                            concurrency_limit=None, **page),
            chatbot.edit(chat.edited, [chatbot, *gen_inputs], chat_outputs,
                         concurrency_limit=None, **page),
            chatbot.example_select(chat.example, [chatbot, *gen_inputs], chat_outputs,
                                   concurrency_limit=None, **page)]
        for reply in replies:  # each reply, once it ends (or stops), is kept in the browser
            reply.then(kept_chats.remember, [chatbot, conversation_id, kept], [kept, past],
                       **page)
        stop_btn.click(chat.stop, None, status, queue=False, **page)
        # Clear through the queue, as the replies' updates go: both reach the page over the
        # same stream, in the order they were made (queue=False answered on a channel of its
        # own, and a reply's last update could land after it and bring the reply back).
        # The chat's own trash icon is a Clear too: by itself it only empties the page, and a
        # reply still streaming brought its turn back.
        def forget(conversation_id, store, request: gr.Request):  # Clear: the chat goes
            return (*chat.clear(conversation_id, request), chats.removed(store, conversation_id))

        for cleared in (clear_btn.click, chatbot.clear):
            cleared(forget, [conversation_id, kept],
                    [chatbot, conversation_id, status, export_file, kept],
                    concurrency_limit=None, **page).then(kept_chats.listed, kept, past, **page)
        # one click: the file is written, then its link clicked, so the download starts
        export_btn.click(chat.export, [chatbot, system, mode], export_file, **page).then(
            None, None, None, js=EXPORT_CLICK)
        for compare in (ab_btn.click, ab_prompt.submit):  # the button, or Enter in the prompt
            compare(ab.run, [ab_prompt, mode_a, mode_b, system, temperature, top_p, top_k,
                             max_new, seed, thinking, min_p, presence, repetition],
                    [ab_status, ab_text_a, ab_text_b, ab_stats_a, ab_stats_b],
                    concurrency_limit=None, **page)
        ab_stop.click(chat.stop, None, ab_status, queue=False, **page)
        # the chat's own controls (its mode, its panels) leave the A/B tab, which has its own
        def showing(shown: bool):
            return lambda: (gr.update(visible=shown),) * 2

        for tab, chat_shown in ((chat_tab, True), (ab_tab, False)):
            tab.select(showing(chat_shown), None, [mode, panels], queue=False, **page)
        timer = gr.Timer(0.5)
        timer.tick(chat.panels, None, [panel, plot], queue=False, show_progress="hidden", **page)

        def closed(request: gr.Request):  # the tab went away: cancel its request
            sessions.close(request.session_hash)

        demo.unload(closed)
        demo.load(kept_chats.restore, kept, [chatbot, conversation_id, kept, past], **page)
        new_btn.click(kept_chats.new_chat, kept,
                      [chatbot, conversation_id, kept, past, status], **page)
        past.input(kept_chats.pick, [past, conversation_id, kept],
                   [chatbot, conversation_id, kept, status], **page)
        import_btn.upload(kept_chats.import_chat, [import_btn, kept],
                          [chatbot, conversation_id, kept, past, system, status], **page)

        add_script_api(service, sessions)
    return demo
