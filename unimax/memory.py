"""The memory plan: what a preset's parts take on the GPU, said at start-up against the card, and
a preset that cannot fit refused before anything is built, with the setting to lower.

Counted from shapes, before any engine exists: the weights (as loaded), the modes' quantized
copies (the FP8 speed mode's tail and verified mode's draft, their shared linears once: the
modes share one exact side, unimax.exact), the attention KV buffers (one set, max_context
tokens), the recurrent states (the exact cache, a decoder's per mode, the verifier's snapshot
and tape), the kept conversation states' GPU budget (state_memory_mib: a cap the store moves
states to host memory past, counted in full) and the prefill's workspace (one chunk's
activations, estimated). The graphs' pools and the compiled steps' workspaces are measured
after the warm-up (``measured``), not planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .cache import AttentionStateSpec, LayerStateSpec
from .fp8 import tail_linear_names
from .int4 import group_for

GB = 1e9
HEADROOM = 0.5 * GB  # the CUDA context's own and the allocator's slack, beyond the parts


class MemoryPlanError(ValueError):
    """A preset that cannot fit the card."""


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    lower: str  # the setting that shrinks it ("" where none does)


def plan(model, preset) -> list[Part]:
    """The preset's parts on ``model`` (loaded), in bytes."""
    cfg = model.config
    # (parameters() lists a tied embedding and LM head once)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.startswith("mtp.")}
    # the FP8 speed mode's view, and verified mode's draft (the MTP module's: no copy)
    kinds = {"tail", preset.draft} - {"mtp"}
    stored: dict[tuple, int] = {}
    for kind in kinds:
        names = tail_linear_names(model) if kind == "tail" else list(linears)
        for name in names:
            int4 = kind == "int4" and name != "lm_head"
            stored[(name, int4)] = _quantized_bytes(linears[name], int4)
    kv, state = _cache_bytes(model)
    element = torch.finfo(model.dtype).bits // 8
    if preset.draft == "mtp" and getattr(model, "mtp", None) is not None:  # (its own KV)
        kv += (cfg.mtp_layers * 2 * cfg.num_key_value_heads * cfg.max_context
               * cfg.attn_head_dim * element)
    chunk = min(preset.prefill_chunk, preset.max_context)
    # a chunk's widest activations: the MLP's gate-up output and its product, the mixers'
    # projections, a few hidden-size tensors (an estimate, within ~2x of the measured peak)
    prefill = chunk * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * element
    return [
        Part("weights", weights, "a smaller model"),
        Part("FP8 / int4 copies (speed tail, verified draft)", sum(stored.values()),
             "draft: tail (verified mode drafting with the speed tail)"),
        Part("attention KV buffers", kv, "max_context"),
        Part("recurrent states (caches, snapshot, tape)", state, ""),
        Part("kept conversation states, at most", preset.state_memory_mib * 2**20,
             "state_memory_mib"),
        Part("prefill workspace, estimated", prefill, "prefill_chunk"),
    ]


def _quantized_bytes(linear: nn.Linear, int4: bool) -> int:
    n, k = linear.out_features, linear.in_features
    group = group_for(k) if int4 else None
    if group is not None:
        return n * k // 2 + n * (k // group) * 2  # packed nibbles, an FP16 scale per group
    n_pad, k_pad = n + (-n) % 16, k + (-k) % 16
    return n_pad * k_pad + 2 * 4 * n_pad  # the FP8 weight and its two scale layouts


def _cache_bytes(model) -> tuple[int, int]:
    """(KV buffers, one set; recurrent states: the exact cache, three decoders', the
    verifier's snapshot and its tape of block_size + 1 steps, counted as six caches)."""
    kv = state = 0
    element = torch.finfo(model.dtype).bits // 8
    for spec in model.layer_state_specs():
        if isinstance(spec, AttentionStateSpec):
            kv += 2 * math.prod(spec.kv_shape) * element
        elif isinstance(spec, LayerStateSpec):  # (conv states in the model's dtype, the
            state += math.prod(spec.conv_shape) * element + math.prod(spec.recurrent_shape) * 4
    return kv, 6 * state  # recurrent ones in fp32)


def capacity() -> int:
    """Bytes this process may allocate on the current GPU: the card's total, or less under
    torch.cuda.set_per_process_memory_fraction."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * (fraction() if fraction is not None else 1.0))


def check(parts: list[Part], available: int) -> None:
    """Raise MemoryPlanError when the parts and the headroom pass ``available`` bytes, naming
    the largest parts a setting shrinks."""
    need = sum(part.bytes for part in parts) + HEADROOM
    if need <= available:
        return
    lowers = sorted((p for p in parts if p.lower), key=lambda p: -p.bytes)
    advice = "; ".join(f"{p.name} {p.bytes / GB:.2f} GB: lower {p.lower}" for p in lowers[:3])
    raise MemoryPlanError(
        f"this preset needs about {need / GB:.1f} GB of GPU memory and this card leaves "
        f"{available / GB:.1f} GB: {advice}")


def describe(parts: list[Part], available: int) -> str:
    lines = [f"  {p.name:<48}{p.bytes / GB:>7.2f} GB" for p in parts]
    total = sum(p.bytes for p in parts)
    lines.append(f"  {'planned':<48}{total / GB:>7.2f} GB of {available / GB:.1f} GB "
                 "(graphs and compiled steps come on top: said after the warm-up)")
    return "\n".join(lines)


def measured(parts: list[Part], kept_bytes: int) -> str:
    """After the warm-up: what is allocated now and at the peak, and what the graphs' pools and
    compiled steps took beyond the planned parts (the kept states counted as they are)."""
    fixed = sum(p.bytes for p in parts if not p.name.startswith(("kept", "prefill")))
    now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    return (f"GPU memory after the warm-up: {now / GB:.2f} GB allocated (peak "
            f"{peak / GB:.2f}, reserved {torch.cuda.memory_reserved() / GB:.2f}); graphs and "
            f"compiled steps {max(0, now - fixed - kept_bytes) / GB:.2f} GB beyond the plan")
