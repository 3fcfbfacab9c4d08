"""The full-FP8 draft's decode step with its small kernels folded into its GEMVs.

A 4B draft step on the H200 is ~12 kernels per layer: four FP8 GEMVs, the convolution and the
recurrence, and six small ones (residual add + RMSNorm twice, the gates' sigmoid, the gated
norm's two, the SwiGLU) at ~1.5-2.5 us each, ~300 us of a ~1.9 ms step, that the FP8 bytes do
not shrink (bench/RESULTS.md). Here a block's FP8 decode step is

    proj = conv(in_proj(rms_norm(h)))            one fused GEMV (prologue "rms"), the short
                                                 convolution in its epilogue (ops.in_proj_conv)
    o, z = the mixer's decode core               the recurrence, sigmoid(b) taken inside its
                                                 kernel
    h = h + out_proj(gated_norm(o, z))           one fused GEMV (prologue "gated", residual)
    gu = gate_up(rms_norm(h))                    one fused GEMV (prologue "rms")
    h = h + down(silu(gate) * up)                one fused GEMV (prologue "swiglu", residual)

(five launches per GDN layer: four GEMVs and fla's recurrence; ~12 before, six before the
convolution was folded (the kernel configuration's ``fold_conv``, on); a
gated-attention block folds its norm, its output gate and both residual adds the same way). The
GEMVs are ops.fused_gemv, whose twin, the torch forms, is what runs off CUDA. Where the linears
are FP8 (a draft view, or the FP8 tail's last MLP), never the exact model: a draft's tokens are
checked by the exact model whatever it computes, so a fused form that rounds a little
differently from the unfused one costs at most acceptance. With ``fuse_bf16`` (on) the BF16
fast step's blocks fold the same way: like the unfused fast step, that step decodes the exact
model's greedy tokens up to BF16 near-ties (its GEMVs sum in another order, its norms' factors
come from another reduction, and sigmoid(b) stays unrounded inside the recurrence's kernel).
The verifier's view folds its one-token forwards too (unimax.verifier.exact_view), with
sigmoid(b) rounded as the exact model rounds it, in the in-projection's epilogue
(``fold_beta``; the torch forms without it); its blocks of k + 1 rows take the plain
forms (a tensor-core form of these folds was exact but slower than the plain GEMMs). The exact
model itself is never folded. Everything else (long prompts, forwards of more than one row,
default grad mode) takes the block's own forward.

The configuration's ``fuse_fp8``: whether unimax.fast_step's view fuses its FP8 linears
(bench/profile_step.py's "draft-nofuse" times the unfused draft beside it); ``fuse_bf16``: its BF16
ones too ("fla+gemv-nofuse" times the BF16 step unfused). H200, 4B: draft step 2008 -> 1840 us, BF16
step 2916 -> 2684 us; 0.8B BF16 step 1116 -> 988 us (bench/RESULTS.md).
"""

from __future__ import annotations

import torch

from . import kernels
from .fp8 import FP8Linear
from .gemv_linear import GemvLinear
from .int4 import Int4Linear
from .layers import GDNBlock
from .ops.fused_gemv import fused_small_m_linear
from .ops.in_proj_conv import fused_in_proj_conv
from .ops.int4_fused import int4_fused_linear, int4_in_proj_conv


def fusable(linear) -> bool:
    """A linear whose decode GEMV the fused kernel replaces: an FP8 linear in the Triton GEMV's
    mode on a GPU with FP8 (the same kernel family), or the CPU's emulation (where the op runs
    the twin, the emulation's own arithmetic); or a BF16 GemvLinear marked ``fused``
    (``fuse_blocks(bf16=True)``); an Int4Linear with the kernel configuration's ``fuse_int4``
    (ops.int4_fused: the kernel on CUDA, its twin elsewhere)."""
    if isinstance(linear, Int4Linear):
        return kernels.active().fuse_int4
    if isinstance(linear, FP8Linear):
        return linear.mode == "fp8_gemv" or (linear.mode == "emulated"
                                             and not linear.weight.is_cuda)
    return getattr(linear, "fused", False)


def fused_linear(linear, x: torch.Tensor, prologue: str, norm=None,
                 z: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(prologue(x)) (+ residual)`` for x (M, ...) through the fused GEMV; ``linear``:
    a ``fusable`` one (FP8, or a marked GemvLinear: no scales); ``norm``: the RMSNorm or
    GatedRMSNorm module whose weight, eps (and offset) the prologue takes."""
    if isinstance(linear, Int4Linear):
        return int4_fused_linear(x, linear.weight, linear.weight_scale, prologue,
                                 None if norm is None else norm.weight, z, residual,
                                 1e-6 if norm is None else norm.eps,
                                 getattr(norm, "offset", 0.0))
    return fused_small_m_linear(
        x, linear.weight, getattr(linear, "weight_scale", None), linear.out_features,
        linear.in_features,
        prologue, None if norm is None else norm.weight, z, residual,
        1e-6 if norm is None else norm.eps, getattr(norm, "offset", 0.0))


def fused_in_proj_conv_linear(mixer, x: torch.Tensor, norm, state,
                              beta: bool = False) -> torch.Tensor:
    """The in-projection of RMSNorm(x) with the convolution folded in (ops.in_proj_conv): a
    one-token decode step's, its conv state rolled; ``beta``: its b channels out as the
    mixer's rounded write strength (the op's beta epilogue)."""
    linear, cfg = mixer.in_proj, mixer.config
    heads = cfg.num_v_heads if beta else 0
    if isinstance(linear, Int4Linear):
        return int4_in_proj_conv(x, linear.weight, linear.weight_scale, norm.weight, norm.eps,
                                 getattr(norm, "offset", 0.0), state.conv_states[0],
                                 mixer.conv_weight, cfg.conv_dim + cfg.value_dim, heads,
                                 cfg.allow_neg_eigval)
    return fused_in_proj_conv(x, linear.weight, getattr(linear, "weight_scale", None),
                              linear.out_features, linear.in_features, norm.weight, norm.eps,
                              getattr(norm, "offset", 0.0), state.conv_states[0],
                              mixer.conv_weight, cfg.conv_dim + cfg.value_dim, heads,
                              cfg.allow_neg_eigval)


class FusedBlock(GDNBlock):
    """A view's block whose forward folds its norms, gates and residual adds into its GEMVs
    (``fused_block_forward``): ``fuse_blocks`` gives a view's blocks this class, so the plain
    block (unimax.layers) knows nothing of the folds."""

    fused = True

    def forward(self, x: torch.Tensor, state) -> torch.Tensor:
        return fused_block_forward(self, x, state)


def fused_block_forward(block, x: torch.Tensor, state) -> torch.Tensor:
    """GDNBlock.forward with its fusable parts fused (module docstring); x (B, T, hidden)."""
    batch, tokens, hidden = x.shape
    rows = batch * tokens
    # Blocks fold one-token forwards (the steps, the verifier's exact runs); the verifier's
    # blocks of k + 1 rows take the plain forms, whose GEMMs choose per shape between the
    # tensor-core kernels and cuBLAS. (The fused op has no backward: a caller in default grad
    # mode gets the plain forms.)
    if rows > 1 or torch.is_grad_enabled() or not x.is_contiguous():
        return block.mlp_part(block.mixer_part(x, state))
    x2 = x.reshape(rows, hidden)
    mixer = block.mixer
    head = mixer.norm.weight.shape[0] if hasattr(mixer, "decode_core") else 0
    if (head and not head & (head - 1)  # (the gated prologue takes power-of-2 heads)
            and fusable(mixer.in_proj) and fusable(mixer.out_proj)):
        if mixer._one_op_step(state, tokens):
            config = kernels.active()
            conv_done = config.fold_conv  # (the convolution in the in-projection's GEMV)
            # (and beta, where it is rounded outside the recurrence: the verifier's view)
            beta_done = conv_done and config.fold_beta and not block.beta_in_kernel
            projected = (fused_in_proj_conv_linear(mixer, x2, block.mixer_norm, state,
                                                   beta_done)
                         if conv_done else fused_linear(mixer.in_proj, x2, "rms",
                                                        block.mixer_norm))
            o, z = mixer.decode_core(projected.reshape(batch, tokens, -1), state,
                                     beta_in_kernel=block.beta_in_kernel, conv_done=conv_done,
                                     beta_done=beta_done)
        else:  # (a one-token forward that is padded, recorded, or on no state)
            projected = fused_linear(mixer.in_proj, x2, "rms", block.mixer_norm)
            o, z = mixer.core(projected.reshape(batch, tokens, -1), state)
        gated = mixer.norm
        h = fused_linear(mixer.out_proj, o.reshape(rows, -1), f"gated_{gated.activation_name}",
                         gated, z=z.reshape(rows, -1), residual=x2)
    elif (hasattr(mixer, "o_proj") and fusable(mixer.in_proj) and fusable(mixer.o_proj)):
        projected = fused_linear(mixer.in_proj, x2, "rms", block.mixer_norm)  # gated attention
        out, gate = mixer.core(projected.reshape(batch, tokens, -1), state)
        h = fused_linear(mixer.o_proj, out.reshape(rows, -1), "sigmoid_gate",
                         z=gate.reshape(rows, -1), residual=x2)
    else:
        h = block.mixer_part(x, state).reshape(rows, hidden)
    mlp = block.mlp
    if not (fusable(mlp.gate_up_proj) and fusable(mlp.down_proj)):
        return block.mlp_part(h.reshape(x.shape))
    gate_up = fused_linear(mlp.gate_up_proj, h, "rms", block.mlp_norm)
    return fused_linear(mlp.down_proj, gate_up, "swiglu", residual=h).reshape(x.shape)


def fuse_blocks(view, bf16: bool = False, beta_in_kernel: bool = True) -> int:
    """Mark the blocks of ``view`` (a view: its blocks and linears are its own shallow copies)
    that hold a fusable linear for the fused forward; returns how many. ``bf16``: its BF16
    GemvLinears too (the BF16 fast step: it already rounds as inductor's fusions do, not as the
    eager model; verified mode stays exact either way): the configuration's ``fuse_bf16``.
    ``beta_in_kernel``: a one-token step takes sigmoid(b) inside the recurrence's kernel,
    unrounded; the verifier's view (unimax.verifier.exact_view) says no, so that its one-token
    forwards round beta as its blocks do. A fused block folds one-token forwards; larger ones
    take the block's own forward."""
    count = 0
    for block in view.layers:
        for module in block.modules() if bf16 else ():
            if isinstance(module, GemvLinear):
                module.fused = True
        if any(fusable(m) for m in block.modules()):
            block.__class__ = FusedBlock  # (a view's own block object: the exact model's
            # keeps its class)
            block.beta_in_kernel = beta_in_kernel
            count += 1
    return count
