"""Turning service stats into what the page shows. Pure functions: no Gradio state, no GPU."""

from __future__ import annotations

import html

import pandas as pd

PANEL_ROWS = [  # key, label, unit / format
    ("mode", "mode", "{}"),
    ("bridge_mib", "bridge size", "{:.2f} MiB"),
    ("bridge_ms", "bridge time", "{:.3f} ms"),
    ("acceptance_rate", "acceptance rate", "{:.1%}"),
    ("drafted_tokens", "drafted", "{}"),
    ("accepted_draft_tokens", "accepted", "{}"),
    ("rejected_blocks", "rejected blocks", "{}"),
    ("mean_draft_length", "drafts per block (chosen per block)", "{:.1f}"),
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


def curve_frame(stats: dict | None) -> pd.DataFrame:
    curve = (stats or {}).get("decode_curve") or []
    return pd.DataFrame(curve, columns=["tokens", "tok_s"]) if curve else \
        pd.DataFrame({"tokens": [], "tok_s": []})


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
               stats_b: dict) -> str:
    start = first_char_difference(text_a, text_b)
    speed_a, speed_b = stats_a.get("decode_tok_s"), stats_b.get("decode_tok_s")
    if speed_a and speed_b:
        ratio = f"{mode_b} decodes at **{speed_b / speed_a:.2f}x** the speed of {mode_a} " \
                f"({speed_b:.1f} vs {speed_a:.1f} tok/s)."
    else:
        ratio = "Speed ratio: not enough tokens to measure."
    same = "The two outputs are **identical**." if start is None else \
        f"The outputs **first diverge at character {start}** (highlighted)."
    return f"{ratio} {same}"
