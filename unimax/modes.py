"""The app's modes, in one table that the presets, the service, the page, the CLI and the benches
read: what each decodes with, which draft it uses, whether it verifies."""

from __future__ import annotations

from dataclasses import dataclass

# The views decode="fp8" runs (unimax.fp8.quantize_view): "tail" (the final MLP and the LM head
# at FP8; state-safe, for fast and verified mode), "full" (every linear FP8) and "int4" (the
# body in 4 bits, the head FP8; opt-in): those two are drafts for verified mode only. "mtp":
# no quantized view; verified mode drafts with the model's own MTP module (unimax.mtp_draft;
# opt-in, Qwen3.5 checkpoints that ship one: greedy replies only so far).
DRAFTS = ("tail", "full", "int4", "mtp")


@dataclass(frozen=True)
class Mode:
    name: str
    label: str  # what the page calls it
    decode: str  # the decoder's precision: "bf16" or "fp8" (build_engine's decode)
    draft: str | None  # the FP8 view: "tail" or "full"; None: the preset's verified draft
    verified: bool  # drafts checked by the exact model (output = exact greedy decoding)

    @property
    def engine_mode(self) -> str:
        """UniMaxEngine.generate's mode."""
        return "verified" if self.verified else "fast"


APP_MODES = {mode.name: mode for mode in (
    Mode("bf16", "BF16 only", "bf16", "tail", False),
    Mode("fp8", "FP8 speed", "fp8", "tail", False),
    Mode("verified", "Verified exact", "fp8", None, True),
)}
MODES = tuple(APP_MODES)
