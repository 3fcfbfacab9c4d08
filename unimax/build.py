"""``build_engine``: an exact model in, a ready UniMaxEngine out (decoder, FP8 view, graphs)."""

from __future__ import annotations

import warnings

from .engine import PREFILL_CHUNK, UniMaxEngine
from .exact import ExactSide
from .fast_step import fast_step_unavailable, gemv_view
from .fp8 import quantize_view
from .graph import MaxTurboGraphDecoder
from .kernels import KernelConfig, active, using
from .modes import DRAFTS
from .mtp_draft import MTPDraft


def build_engine(model, decode: str = "bf16", block_size: int = 8, draft: str = "tail",
                 use_graphs: bool | None = None, fp8_mode: str | None = None,
                 compile_step: bool | str = False,
                 prefill_chunk: int = PREFILL_CHUNK,
                 exact: ExactSide | None = None,
                 kernels: KernelConfig | None = None) -> UniMaxEngine:
    """decode='bf16': the decoder runs the exact model itself. decode='fp8': it runs a view with
    FP8 linears sharing every other weight: draft='tail' (final MLP + LM head; state-safe, good
    for fast and verified mode) or draft='full' (every linear; verified mode only), or
    draft='int4' (verified mode only, opt-in: the full draft with its body in 4 bits and its LM
    head at FP8, unimax.int4: fewer bytes a draft step, some acceptance lost), or draft='mtp'
    (opt-in, a model with Qwen3.5's MTP module: no FP8 view, verified mode's drafts from the
    MTP module, unimax.mtp_draft; the decoder is the model's own, as BF16-only's).
    Graphs are captured on CUDA by default, lazily at the first block of each size.

    compile_step: the fast step (unimax.fast_step), CUDA only: the decoder runs a view of its
    model whose plain linears use the Triton GEMV, and its one-token step goes through
    torch.compile (inductor) before it is captured. On the H200 it took BF16 decoding from
    ~290 to 730 tok/s (0.8B shape) and 544 tok/s (1.3B shape), 27-35% of the bandwidth floor
    (bench/RESULTS.md), for 5-45 s of compilation on first use. Its rounding differs from the
    exact model's (fused kernels), so BF16 fast decoding may take the other side of a near-tie;
    verified mode stays exact. Prefill and verification run the exact model, untouched. Off
    CUDA, or without Triton, True is ignored with a warning that says why; "auto" turns it on
    exactly where it can run, silently.

    prefill_chunk: prompt tokens per prefill forward (UniMaxEngine.prefill_exact).

    exact: the exact side (unimax.exact) shared with the other modes' engines of ``model``: its
    cache and KV buffers, prefill graphs and quantized linears; by default one of its own.

    kernels: which kernel form each fast path takes (unimax.kernels; default: the one in force,
    which outside every engine is the measured winners'). The engine keeps it, in force while it
    is built and while its calls run."""
    config = kernels or active()
    if not isinstance(config, KernelConfig):
        raise TypeError(f"kernels must be a unimax.kernels.KernelConfig, got "
                        f"{type(kernels).__name__}")
    with using(config):
        return _build(model, decode, block_size, draft, use_graphs, fp8_mode, compile_step,
                      prefill_chunk, exact, config)


def _build(model, decode, block_size, draft, use_graphs, fp8_mode, compile_step, prefill_chunk,
           exact, config) -> UniMaxEngine:
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
    if not hasattr(model, "make_recurrent_cache"):
        raise TypeError(f"{type(model).__name__} has no recurrent cache (make_recurrent_cache); "
                        "UNI MAX runs recurrent GDN models from unimax.load_model")
    drafter = None
    if decode == "bf16":
        decode_model, state_safe = model, True
    elif decode == "fp8" and draft == "mtp":  # (verified mode drafts with the MTP module)
        decode_model, state_safe = model, True
        drafter = MTPDraft(model, block_size)
    elif decode == "fp8":
        if draft not in DRAFTS:
            raise ValueError(f"unknown draft {draft!r}; use one of {', '.join(DRAFTS)}")
        decode_model = quantize_view(model, draft, mode=fp8_mode,
                                     store=exact.quantized if exact is not None else None)
        state_safe = draft == "tail"
    else:
        raise ValueError(f"unknown decode mode {decode!r}; use 'bf16' or 'fp8'")
    if compile_step not in (True, False, "auto"):
        raise ValueError(f"compile_step must be True, False or 'auto', got {compile_step!r}")
    reason = fast_step_unavailable(model.device) if compile_step else None
    if reason and compile_step is True:
        warnings.warn(reason, stacklevel=3)  # (the caller of build_engine)
    compile_step = bool(compile_step) and reason is None
    if compile_step:
        decode_model = gemv_view(decode_model)
        # fla's fused recurrent kernel where it runs ("auto"), measured faster inside the
        # compiled step than inductor's fusion of the torch loop
        decode_model.set_backend("auto")
    graph = MaxTurboGraphDecoder(decode_model, block_size=block_size, use_graphs=use_graphs,
                                 compile=compile_step)
    # The verifier's k-token forward of the exact model is compiled like the step: one weight
    # read per block is its floor, and uncompiled it pays the elementwise launches too.
    engine = UniMaxEngine(model, decode_model, graph, state_safe_draft=state_safe,
                          compile_verifier=compile_step, exact=exact, kernels=config,
                          drafter=drafter)
    engine.prefill_chunk = prefill_chunk
    return engine
