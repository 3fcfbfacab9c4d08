"""flash-linear-attention's gated delta rule kernels, looked up once (``fla_ops``) and run with
our semantics (``fla_run``)."""

from __future__ import annotations

_FLA: list = []  # [fla_ops' answer], once looked up


def fla_ops():
    """flash-linear-attention's kernels, or None. Imported lazily and only for CUDA work:
    an importable fla also redirects transformers' CPU reference to Triton.

    Remembered in a plain list, not functools.cache: torch.compile traces through a cache
    wrapper (warning that it ignores it) and runs the import inside every trace, while it
    reads a list already filled as a constant. The engines look fla up before they compile
    (``fla_ops`` in unimax.graph and unimax.verifier), so a compiled step never imports."""
    if not _FLA:
        try:
            from fla.ops.gated_delta_rule import (
                chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule,
            )
        except Exception:  # ImportError, or Triton failing to initialise on this machine
            _FLA.append(None)
        else:
            _FLA.append((chunk_gated_delta_rule, fused_recurrent_gated_delta_rule))
    return _FLA[0]


def fla_run(kernel, q, k, v, g, beta, initial_state, final_state: bool):
    """One of fla's two kernels (``fla_ops``) with our semantics: (o, final state or None)."""
    # Keywords only: the two kernels' positional orders differ (fused_recurrent has gk, gv
    # between g and beta).
    return kernel(q=q, k=k, v=v, g=g.float(), beta=beta, initial_state=initial_state,
                  output_final_state=final_state, use_qk_l2norm_in_kernel=True)
