"""A GDN mixer's one-token decode step as one op: the short convolution and the gated delta rule,
both states updated in place: ``gdn_decode_step(mixed, a, beta, conv_state, conv_weight,
recurrent_state, A_log, dt_bias, num_k_heads) -> o``.

mixed (B, 1, conv_dim) is the in-projection's [q | k | v] part before the convolution; a, beta
(B, 1, HV) the raw decay input and the (activated) write strength; conv_state (B, conv_dim, W);
recurrent_state (B, HV, K, V) fp32; o (B, 1, HV, V) in mixed's dtype. The gate is
g = -exp(A_log) * softplus(a + dt_bias), in fp32 as the mixer computes it.

Why: written as torch ops, the step between the in-projection and the gated norm compiled to ~11
small kernels per layer (the window's concatenation, its copy back into the cache, q, k, v, g and
beta made contiguous one kernel each, the recurrence, the fresh final state copied into the
cache). As this op, a compiled 4B step went from 614 kernels to 390 and from 3330 to 2940 us
(BF16) and 2401 to 2020 (full-FP8 draft) on the H200 (bench/profile_step.py, "-unfused" beside
it; bench/RESULTS.md). On CUDA this op is two launches of fla's kernels:
``causal_conv1d_update``'s (the window rolled in place, SiLU fused) and the fused recurrent kernel
launched with its final state written over its initial state (each program reads its tile of
the state before the loop and writes it after, so the same buffer can be both) and the gate
computed inside (``A_log``, ``dt_bias``), reading q, k and v where the convolution wrote them.
As a torch custom op it is one opaque call to inductor, which keeps the states' buffers (no
clone, no copy back: the mutation is declared).

``gdn_decode_step_ref`` is the plain twin (the mixer's torch forms), which the op runs off CUDA.
beta stays an input: the mixer rounds sigmoid(b) to the activation dtype as transformers' Qwen3.5
layer does, where fla's in-kernel sigmoid would keep fp32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .conv import causal_conv1d_step
from .gated_delta import fla_ops, recurrent_gated_delta_rule_ref


def _split_heads(mixed: torch.Tensor, num_k_heads: int, value_heads: int, head_v_dim: int):
    """(B, 1, conv_dim) -> q, k (B, 1, H, K) and v (B, 1, HV, V), as views."""
    batch = mixed.shape[0]
    key_dim = (mixed.shape[-1] - value_heads * head_v_dim) // 2
    q, k, v = torch.split(mixed, [key_dim, key_dim, value_heads * head_v_dim], dim=-1)
    return (q.reshape(batch, 1, num_k_heads, -1), k.reshape(batch, 1, num_k_heads, -1),
            v.reshape(batch, 1, value_heads, head_v_dim))


def decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The log-decay g = -exp(A_log) * softplus(a + dt_bias), fp32 (the mixer's formula)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def write_strength(b: torch.Tensor, neg_eigval: bool) -> torch.Tensor:
    """beta = sigmoid(b) in b's dtype (rounded, as transformers' Qwen3.5 layer rounds it),
    doubled where the model allows negative eigenvalues."""
    return b.sigmoid() * 2.0 if neg_eigval else b.sigmoid()


def gdn_decode_step_ref(mixed, a, beta, conv_state, conv_weight, recurrent_state, A_log,
                        dt_bias, num_k_heads: int, beta_logits: bool = False,
                        conv_done: bool = False) -> torch.Tensor:
    """The twin: the mixer's own torch forms, the states written with copy_."""
    if beta_logits:  # fp32, as fla's kernel takes the sigmoid
        beta = beta.float().sigmoid()
    if conv_done:
        y = mixed
    else:
        y, window = causal_conv1d_step(mixed, conv_weight, conv_state)
        conv_state.copy_(window)
    value_heads, _, head_v_dim = recurrent_state.shape[1:]
    q, k, v = _split_heads(y, num_k_heads, value_heads, head_v_dim)
    o, state = recurrent_gated_delta_rule_ref(q, k, v, decay(a, A_log, dt_bias), beta,
                                              recurrent_state)
    recurrent_state.copy_(state)
    return o


def fla_conv_step(mixed: torch.Tensor, conv_state: torch.Tensor,
                  conv_weight: torch.Tensor) -> torch.Tensor:
    """fla's ``causal_conv1d_update`` kernel, launched as its wrapper launches it but reading
    mixed in place: SiLU(conv) of the new token (B, 1, conv_dim), the window rolled in place.
    (Triton's interpreter casts its output to BF16 by truncation where the GPU rounds to
    nearest: tests/ops/test_decode_step.py.)"""
    import triton
    from fla.modules.causal_conv1d.ops import causal_conv1d_update_kernel as kernel

    batch, _, conv_dim = mixed.shape
    y = mixed.new_empty(batch, 1, conv_dim)
    width = conv_weight.shape[1]
    args = dict(x=mixed, cache=conv_state, residual=None, y=y, weight=conv_weight, bias=None,
                stride_x_n=mixed.stride(0), stride_x_d=mixed.stride(2), stride_y_n=conv_dim,
                stride_y_d=1, D=conv_dim, W=width, BW=triton.next_power_of_2(width),
                ACTIVATION="silu")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter cannot autotune: one tile
        kernel.fn.fn[(triton.cdiv(conv_dim, 64) * batch,)](
            **args, BD=64, USE_INITIAL_STATE=True, HAS_WEIGHT=True, HAS_BIAS=False,
            HAS_RESIDUAL=False)
    else:
        kernel[lambda meta: (triton.cdiv(conv_dim, meta["BD"]) * batch,)](**args)
    return y


def fla_recurrent_step(y: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
                       recurrent_state: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, num_k_heads: int,
                       beta_logits: bool = False) -> torch.Tensor:
    """fla's fused recurrent kernel for one token of the convolved y (B, 1, conv_dim), the
    state updated in place, the gate computed inside: o (B, 1, HV, V)."""
    value_heads, _, head_v_dim = recurrent_state.shape[1:]
    q, k, v = _split_heads(y, num_k_heads, value_heads, head_v_dim)
    if y.shape[0] > 1:  # the kernel steps sequences by H * K: only one may read in place
        q, k, v, a = q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous()
    return launch_recurrent(q, k, v, a, beta.contiguous(), recurrent_state, A_log, dt_bias,
                            beta_sigmoid=beta_logits)


def launch_recurrent(q, k, v, a, beta, state, A_log, dt_bias, block_v: int = 8,
                     num_warps: int = 1, num_stages: int = 3,
                     beta_sigmoid: bool = False) -> torch.Tensor:
    """fla's fused recurrent kernel over T tokens, q, k (B, T, H, K), v (B, T, HV, V), a and
    beta (B, T, HV) laid out as contiguous tensors would be (one token: any views with those
    starts), the state (B, HV, K, V) read and written in place, the gate from a inside. The
    launch settings default to fla's own (BV 8, one warp); bench/recurrent.py times others.
    ``beta_sigmoid``: beta holds b, the kernel takes sigmoid(b) in fp32."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import (
        fused_recurrent_gated_delta_rule_fwd_kernel as kernel,
    )

    batch, tokens, num_k_heads, head_k_dim = q.shape
    value_heads, head_v_dim = v.shape[2:]
    o = v.new_empty(batch, tokens, value_heads, head_v_dim)
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    kernel[(triton.cdiv(head_v_dim, block_v) * batch * value_heads,)](
        q=q, k=k, v=v, g=a, gk=None, gv=None, beta=beta, A_log=A_log, dt_bias=dt_bias, o=o,
        h0=state, ht=state, cu_seqlens=None, scale=head_k_dim ** -0.5, T=tokens,
        H=num_k_heads, HV=value_heads, K=head_k_dim, V=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim), BV=block_v, IS_BETA_HEADWISE=True,
        USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=beta_sigmoid, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=num_warps, num_stages=num_stages)
    return o


def _fla_decode_step(mixed, a, beta, conv_state, conv_weight, recurrent_state, A_log, dt_bias,
                     num_k_heads: int, beta_logits: bool = False,
                     conv_done: bool = False) -> torch.Tensor:
    y = mixed if conv_done else fla_conv_step(mixed, conv_state, conv_weight)
    return fla_recurrent_step(y, a, beta, recurrent_state, A_log, dt_bias, num_k_heads,
                              beta_logits)


def check_inputs(mixed, a, beta, conv_state, conv_weight, recurrent_state, num_k_heads: int):
    """Names what is wrong with a call's shapes, dtypes or layouts (the kernels assume them)."""
    batch, tokens, conv_dim = mixed.shape
    value_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    problems = []
    if tokens != 1:
        problems.append(f"one token per call, got {tokens}")
    if conv_dim != 2 * num_k_heads * head_k_dim + value_heads * head_v_dim:
        problems.append(f"mixed has {conv_dim} channels; the state's heads make "
                        f"{2 * num_k_heads * head_k_dim + value_heads * head_v_dim}")
    if a.shape != (batch, 1, value_heads) or beta.shape != (batch, 1, value_heads):
        problems.append(f"a and beta must be {(batch, 1, value_heads)}, got "
                        f"{tuple(a.shape)} and {tuple(beta.shape)}")
    if conv_state.shape != (batch, conv_dim, conv_weight.shape[1]) or \
            conv_weight.shape[0] != conv_dim:
        problems.append(f"conv_state {tuple(conv_state.shape)} / conv_weight "
                        f"{tuple(conv_weight.shape)} do not fit {conv_dim} channels")
    if recurrent_state.dtype != torch.float32 or recurrent_state.shape[0] != batch:
        problems.append("recurrent_state must be fp32 with the batch's sequences")
    if not (conv_state.is_contiguous() and recurrent_state.is_contiguous()):
        problems.append("the states must be contiguous (they are written in place)")
    if value_heads % num_k_heads:
        problems.append(f"value heads ({value_heads}) must be a multiple of key heads "
                        f"({num_k_heads})")
    if problems:
        raise ValueError("gdn_decode_step: " + "; ".join(problems))


@torch.library.custom_op("unimax::gdn_decode_step",
                         mutates_args=("conv_state", "recurrent_state"))
def gdn_decode_step(mixed: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
                    conv_state: torch.Tensor, conv_weight: torch.Tensor,
                    recurrent_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    num_k_heads: int, beta_logits: bool = False,
                    conv_done: bool = False) -> torch.Tensor:
    """One token through a GDN mixer's convolution and recurrence; fla's kernels on CUDA.
    ``beta_logits``: beta holds b itself and the kernel takes sigmoid(b) (fp32, where the
    mixer rounds it to the activation dtype first): the draft's step (unimax.fused_draft), one
    kernel fewer per layer. ``conv_done``: mixed is already the convolution's output and
    conv_state already rolled (ops.in_proj_conv, which folds the convolution into the
    in-projection): the recurrence only."""
    check_inputs(mixed, a, beta, conv_state, conv_weight, recurrent_state, num_k_heads)
    step = _fla_decode_step if mixed.is_cuda and fla_ops() is not None else gdn_decode_step_ref
    return step(mixed, a, beta, conv_state, conv_weight, recurrent_state, A_log, dt_bias,
                num_k_heads, beta_logits, conv_done)


@gdn_decode_step.register_fake
def _(mixed, a, beta, conv_state, conv_weight, recurrent_state, A_log, dt_bias, num_k_heads,
      beta_logits=False, conv_done=False):
    value_heads, _, head_v_dim = recurrent_state.shape[1:]
    return mixed.new_empty(mixed.shape[0], 1, value_heads, head_v_dim)
