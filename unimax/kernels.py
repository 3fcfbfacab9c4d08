"""Which kernel form each fast path takes: one configuration object per engine.

``build_engine(kernels=KernelConfig(...))`` gives an engine its configuration; the engine keeps
it in force (``using``) while it is built and while any of its calls runs, on that thread
only, and the ops read it there (``active()``). So two engines built with two configurations
compare two forms in one process (the benches' A/Bs), two engines on two threads never see
each other's, and no module-level switch is flipped by anyone. Outside every engine call the
default is in force. Graphs and compiled forwards keep the forms they were captured with:
torch.compile guards on the configuration read while tracing.

Every field's default is the measured winner on the app's path (bench/RESULTS.md has the
figures); the other value stays where a bench or a test compares against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

PDL_SETTINGS = (False, True, "fp8")
PDL_TRIGGERS = ("start", "end")


@dataclass(frozen=True)
class KernelConfig:
    # Programmatic dependent launch of the Triton GEMVs and tensor-core GEMMs (compute
    # capability 9+): "auto" lets each owner of graphs (a decoder, the verifier) time its
    # largest block with and without it and keep the faster (unimax.graph.timed_pdl_choice),
    # since its sign depends on the shape and the run (0.8B draft step 5-7% faster, 4B 4%
    # slower on the H200); False, True or "fp8" (FP8 weights only) set it for every launch.
    pdl: bool | str = "auto"
    # Where a programmatic launch signals the next kernel: "start" (before its K loop), "end"
    # (after it), or "auto": what the block's timed choice says (the 4B draft kept the end
    # signal, -2.2%, where it refused the start one, +4.3%; the 0.8B BF16 step the start one).
    pdl_trigger: str = "auto"
    # The TMA forms of the fused GEMV offered to its timed choice where they fit (Hopper).
    tma: bool = True
    # The fast step's view fuses its FP8 linears (prologue, GEMV and epilogue in one kernel;
    # H200 4B draft step 2008 -> 1840 us), its BF16 ones too (BF16 step 2916 -> 2684 us),
    # and the int4 draft's (verified 1.48x / 1.25x BF16-only against 1.33x / 1.12x unfused).
    fuse_fp8: bool = True
    fuse_bf16: bool = True
    fuse_int4: bool = True
    # The folded blocks take the short convolution into the in-projection's GEMV, and in the
    # verifier's view beta's sigmoid into its epilogue too.
    fold_conv: bool = True
    fold_beta: bool = True
    # The verifier view's MLPs run SwiGLU in the gate-up GEMM's epilogue (ops.gemv_swiglu);
    # its recording mixers write the tape in the in-projection's epilogue (ops.in_proj_tape:
    # verify 8 at 0.8B 1.349 against 1.488 ms).
    swiglu_epilogue: bool = True
    tape_epilogue: bool = True
    # The verifier's rewind moves the GDN states in one pass (read once, written three times)
    # instead of snapshot, rewind, copy and resync (4B: 67 MB read and written four times).
    one_pass_rewind: bool = True
    # The verifier compiles one forward per span block: block_size and the powers of two from
    # this one up to it (at 4: 0.96x BF16-only against 1.23x at 8, 4B shape, H100).
    shortest_span_block: int = 8
    # Up to this many tokens over a graph's window attend through ops.decode_attention, which
    # reads only the stored entries (0: never; H200, 9 tokens over 4096 entries at 4B heads
    # 13.4 us against 56.0 with rows_attention); the verifier's blocks of up to this many rows
    # take rows_attention where the op does not serve (8 rows over 4k keys: 259 against
    # SDPA's 414 us).
    decode_attention_tokens: int = 17
    rows_attention_max: int = 9
    # The verifier's recording forwards write the tape in one op on CUDA (ops.block_mixer)
    # instead of the torch forms.
    block_op: bool = True
    # Prompts of more than ops.conv.LONG tokens run fla's fused norm kernels (CUDA): 16k
    # tokens of the 0.8B shape 100.0 -> 94.0 ms, 512 7.5 -> 6.1 ms on the H200.
    fla_prompt_kernels: bool = True

    def __post_init__(self) -> None:
        if self.pdl not in (*PDL_SETTINGS, "auto"):
            raise ValueError(f"kernels pdl must be False, True, 'fp8' or 'auto', got "
                             f"{self.pdl!r}")
        if self.pdl_trigger not in (*PDL_TRIGGERS, "auto"):
            raise ValueError(f"kernels pdl_trigger must be 'start', 'end' or 'auto', got "
                             f"{self.pdl_trigger!r}")
        for name in ("shortest_span_block", "decode_attention_tokens", "rows_attention_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kernels {name} must be an integer >= 0, got {value!r}")
        if self.shortest_span_block < 1:
            raise ValueError("kernels shortest_span_block must be >= 1")

    def but(self, **changes) -> KernelConfig:
        """This configuration with ``changes`` (one form against another in an A/B)."""
        return dataclasses.replace(self, **changes)


DEFAULT = KernelConfig()
_ACTIVE = threading.local()


def active() -> KernelConfig:
    """The configuration in force on this thread: the running engine's, else the default."""
    return getattr(_ACTIVE, "config", None) or DEFAULT


@contextlib.contextmanager
def using(config: KernelConfig | None) -> Iterator[KernelConfig]:
    """``config`` in force on this thread inside the block (None: whatever is in force)."""
    before = getattr(_ACTIVE, "config", None)
    if config is not None:
        _ACTIVE.config = config
    try:
        yield active()
    finally:
        _ACTIVE.config = before
