"""Turning service stats into what the page shows. Pure functions: no Gradio state, no GPU."""

from __future__ import annotations

import html
import math

PANEL_ROWS = [  # key, label, unit / format
    ("mode", "mode", "{}"),
    ("bridge_mib", "bridge size", "{:.2f} MiB"),
    ("bridge_ms", "bridge time", "{:.3f} ms"),
    ("acceptance_rate", "acceptance rate", "{:.1%}"),
    ("drafted_tokens", "drafted", "{}"),
    ("accepted_draft_tokens", "accepted", "{}"),
    ("rejected_blocks", "rejected blocks", "{}"),
    ("mean_draft_length", "drafts per block", "{:.1f}"),
    ("decode_tok_s", "decode", "{:.1f} tok/s"),
    ("prefill_tok_s", "prefill", "{:.0f} tok/s"),
    ("ttft_ms", "time to first token", "{:.1f} ms"),
    ("prefilled_tokens", "tokens prefilled this turn", "{}"),
    ("reused_tokens", "tokens reused from kept state", "{}"),
    ("generated_tokens", "tokens generated", "{}"),
]


def panel_markdown(stats: dict | None) -> str:
    if not stats or "prefilled_tokens" not in stats:
        return "_No reply yet: the panels fill while a reply streams._"
    lines = ["| metric | value |", "|---|---|"]
    for key, label, fmt in PANEL_ROWS:
        value = stats.get(key)
        if value is None and key == "acceptance_rate":
            shown = ("— (no drafts: every block was an exact step)"
                     if stats.get("drafted_tokens") == 0 else "— (verified mode only)")
        elif value is None:
            shown = "—"
        else:
            shown = fmt.format(value)
        lines.append(f"| {label} | {shown} |")
    if (stats.get("accepted_draft_tokens") or 0) >= (stats.get("generated_tokens") or 0) > 0:
        lines.append("\n_Drafted and accepted count every verified draft, also those past the "
                     "end of the reply (a stop token or the length limit), which are not "
                     "shown._")
    return "\n".join(lines)


def warm_up_line(state: dict) -> str:
    """The start-up's progress while it runs (EngineService.warm_up_snapshot), for the top of
    the panels: each mode ready (seconds after the warm-up began), warming up, or waiting;
    then the kernel choices still being timed; empty once all is done."""
    ready = [f"{mode} ready ({state.get('seconds', {}).get(mode, 0):.0f} s)"
             for mode in state.get("ready", [])]
    running = [f"{state['running']} warming up"] if state.get("running") else []
    waiting = [f"{mode} waiting" for mode in state.get("pending", [])]
    if not running and not waiting:
        left = state.get("tuning") or 0
        return f"_Start-up: every mode ready; timing {left} kernel choices for the next " \
               "start, between replies._\n\n" if left else ""
    return "_Start-up: " + " · ".join(ready + running + waiting) + "._\n\n"


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^n at or above ``value`` (an axis end)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10 ** exponent
        if top >= value * (1 - 1e-9):
            return float(top)
    return float(10 ** (exponent + 1))


def curve_svg(stats: dict | None, width: int = 320, height: int = 170) -> str:
    """The decode rate so far over the reply (stats' ``decode_curve``: [tokens, tok/s] per
    block) as a small inline SVG: axes from zero to a round number, a point per block. Drawn
    here rather than by Gradio's plot component, whose chart library warns about its own spec
    version in the browser console on every page. Empty when there is no curve."""
    curve = [(float(t), float(r)) for t, r in (stats or {}).get("decode_curve") or []]
    if not curve:
        return ""
    left, right, top, bottom = 44, 10, 22, 26
    plot_w, plot_h = width - left - right, height - top - bottom
    x_max = nice_ceiling(max(t for t, _ in curve))
    y_max = nice_ceiling(max(r for _, r in curve) * 1.1)

    def x(t):
        return left + plot_w * t / x_max

    def y(r):
        return top + plot_h * (1 - r / y_max)

    points = " ".join(f"{x(t):.1f},{y(r):.1f}" for t, r in curve)
    dots = "".join(f"<circle cx='{x(t):.1f}' cy='{y(r):.1f}' r='2'/>" for t, r in curve)
    grid = "".join(
        f"<line x1='{left}' x2='{left + plot_w}' y1='{y(v):.1f}' y2='{y(v):.1f}' "
        f"stroke='#ddd'/><text x='{left - 4}' y='{y(v) + 4:.1f}' text-anchor='end'>"
        f"{v:g}</text>" for v in (0.0, y_max / 2, y_max))
    x_ticks = "".join(
        f"<text x='{x(v):.1f}' y='{top + plot_h + 14}' text-anchor='middle'>{v:g}</text>"
        for v in (0.0, x_max / 2, x_max))
    last_t, last_r = curve[-1]
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='tok-s-curve' width='{width}' "
        f"height='{height}' font-size='10' font-family='sans-serif' role='img' "
        f"aria-label='decode tok/s over the reply, now {last_r:.1f} tok/s at {last_t:g} "
        f"tokens'><text x='{left}' y='12' font-size='11'>decode tok/s so far · tokens →"
        f"</text>{grid}{x_ticks}<line x1='{left}' x2='{left}' y1='{top}' "
        f"y2='{top + plot_h}' stroke='#999'/><polyline fill='none' stroke='#ff7c00' "
        f"stroke-width='2' points='{points}'/><g fill='#ff7c00'>{dots}</g></svg>")


def first_char_difference(a: str, b: str) -> int | None:
    """Index of the first differing character, or None when identical."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def highlighted(text: str, start: int | None) -> str:
    """HTML of ``text`` with everything from ``start`` on marked."""
    if start is None:
        return f"<pre class='ab-text'>{html.escape(text)}</pre>"
    return (f"<pre class='ab-text'>{html.escape(text[:start])}<mark class='ab-diverge'>"
            f"{html.escape(text[start:]) or '∅'}</mark></pre>")


def ab_summary(mode_a: str, text_a: str, stats_a: dict, mode_b: str, text_b: str,
               stats_b: dict, temperature: float = 0.0) -> str:
    """The A/B verdict: the speed ratio, and whether the texts agree; when sampling, texts are
    not comparable one to one, so it says which distribution each side samples from."""
    start = first_char_difference(text_a, text_b)
    speed_a, speed_b = stats_a.get("decode_tok_s"), stats_b.get("decode_tok_s")
    if speed_a and speed_b:
        ratio = f"{mode_b} decodes at **{speed_b / speed_a:.2f}x** the speed of {mode_a} " \
                f"({speed_b:.1f} vs {speed_a:.1f} tok/s)."
    else:
        ratio = "Speed ratio: not enough tokens to measure."
    same = "The two outputs are **identical**." if start is None else \
        f"The outputs **first diverge at character {start}** (highlighted)."
    if temperature > 0:
        exact = {"bf16": "the exact model's", "verified": "the exact model's (speculative "
                 "sampling: FP8 drafts, exact distribution)", "fp8": "the FP8 tail's"}
        same = (f"Both sides sample at temperature {temperature:g} with the same seed, so "
                f"texts may differ by chance: {mode_a} draws from {exact.get(mode_a, mode_a)} "
                f"distribution, {mode_b} from {exact.get(mode_b, mode_b)}. "
                + ("Same distribution." if exact.get(mode_a, "").startswith("the exact") and
                   exact.get(mode_b, "").startswith("the exact") else
                   "Not the same distribution."))
    why = slower_note(mode_a, stats_a, mode_b, stats_b)
    return f"{ratio} {same}" + (f" {why}" if why else "")


def slower_note(mode_a: str, stats_a: dict, mode_b: str, stats_b: dict) -> str:
    """Why an FP8 mode (fp8, verified) decoded slower than BF16-only, from its own stats: a user
    comparing the modes should not have to guess whether it is broken. Empty otherwise."""
    speeds = {mode_a: stats_a.get("decode_tok_s"), mode_b: stats_b.get("decode_tok_s")}
    slow = mode_b if mode_a == "bf16" else mode_a if mode_b == "bf16" else None
    if slow not in ("fp8", "verified") or not all(speeds.values()) or \
            speeds[slow] >= speeds["bf16"]:
        return ""
    stats = stats_b if slow == mode_b else stats_a
    if str(stats.get("device", "")).startswith("cpu"):
        return (f"On the CPU FP8 is emulated (each step dequantizes the FP8 weights and "
                f"multiplies in float32), so an FP8 step costs more than a BF16 one and {slow} "
                f"mode is slower here by construction; its speed needs a GPU.")
    if slow == "fp8":
        return ("The FP8 tail saves only the final MLP's and LM head's bytes: that pays "
                "where a step is bound by reading weights (a large model), not where its "
                "kernel launches bound it (a small one), which its extra kernels then slow.")
    if not stats.get("drafted_tokens"):
        return ("Verified mode drafted nothing: its draft-length policy ran the exact "
                "model a token at a time, since drafts did not pay at the acceptance it had "
                "measured, which is about BF16-only's speed.")
    accepted = stats.get("acceptance_rate")
    rate = f" at this reply's acceptance ({accepted:.0%})" if accepted is not None else ""
    return (f"Verified mode pays where a draft step costs well under a BF16 step and most "
            f"drafts are accepted: a model that reads gigabytes a token on a GPU whose step "
            f"is bound by memory bandwidth. Here{rate} the drafts and their check cost more "
            f"than the exact steps they replaced.")
