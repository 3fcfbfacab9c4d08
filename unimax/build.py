"""``build_engine``: an exact model in, a ready UniMaxEngine out (decoder, FP8 view, graphs)."""

from __future__ import annotations

from .engine import UniMaxEngine
from .fp8 import quantize_view, shallow_view
from .graph import MaxTurboGraphDecoder


def build_engine(model, decode: str = "bf16", block_size: int = 8, draft: str = "tail",
                 use_graphs: bool | None = None, fp8_mode: str | None = None,
                 compile_step: bool = False) -> UniMaxEngine:
    """decode='bf16': the decoder runs the exact model itself. decode='fp8': it runs a view with
    FP8 linears sharing every other weight: draft='tail' (final MLP + LM head; state-safe, good
    for fast and verified mode) or draft='full' (every linear; verified mode only).
    Graphs are captured on CUDA by default, lazily at the first block of each size.

    compile_step: the decoder's one-token step goes through torch.compile (inductor) before it
    is captured: on the H200 this took gdn-1.3b from 294 to 526 tok/s (bench/RESULTS.md) at the
    price of ~35 s of compilation on first use. The compiled step runs the pure-torch recurrent
    kernel on its own view of the model, so prefill and verification keep fla's kernels."""
    if not hasattr(model, "make_recurrent_cache"):
        raise TypeError(f"{type(model).__name__} has no recurrent cache (make_recurrent_cache); "
                        "UNI MAX runs recurrent GDN models from unimax.load_model")
    if decode == "bf16":
        decode_model, state_safe = model, True
    elif decode == "fp8":
        if draft not in ("tail", "full"):
            raise ValueError(f"unknown draft {draft!r}; use 'tail' or 'full'")
        decode_model, state_safe = quantize_view(model, draft, mode=fp8_mode), draft == "tail"
    else:
        raise ValueError(f"unknown decode mode {decode!r}; use 'bf16' or 'fp8'")
    if compile_step:
        if decode_model is model:
            decode_model = shallow_view(model)
        decode_model.set_backend("torch")
    graph = MaxTurboGraphDecoder(decode_model, block_size=block_size, use_graphs=use_graphs,
                                 compile=compile_step)
    return UniMaxEngine(model, decode_model, graph, state_safe_draft=state_safe)
