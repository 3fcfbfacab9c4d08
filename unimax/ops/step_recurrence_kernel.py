"""The Triton kernel behind unimax.ops.decode_step's programmatic-launch step (imported lazily:
Triton and fla are needed only for CUDA work and the interpreter tests). The launch and the
switch live there."""

import triton
import triton.language as tl
from fla.ops.utils.op import exp
from fla.ops.utils.softplus import softplus

from .gemv_kernels import launch_dependents, wait_for_the_kernel_before


@triton.jit
def step_recurrence_kernel(q, k, v, a, beta, A_log, dt_bias, o, h, scale,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           BETA_SIGMOID: tl.constexpr, PDL: tl.constexpr = False):
    """One token of the gated delta rule for one (sequence, value head, BV columns of V), the
    state h (B, HV, K, V) fp32 read and written in place: fla's fused recurrent kernel at one
    token line for line (its exp and softplus, q and k L2-normalized with 1e-6 inside the
    sqrt, q scaled, the gate -exp(A_log) softplus(a + dt_bias), beta per head, sigmoid(b) in
    fp32 with BETA_SIGMOID; h *= exp(g); v' = beta (v - h^T k); h += k v'^T; o = h^T q), at
    fla's launch (BV columns, one warp, the same program order), so that its sums round as
    fla's do. Inputs laid out as fla's kernel reads them (q, k (B, 1, H, K), v (B, 1, HV, V),
    a and beta (B, 1, HV), each at its sequence's start).

    What it adds is ``PDL`` (programmatic dependent launch, compute capability 9+; fla's
    kernel has no such form): the kernel lets the next one (the out-projection's GEMV)
    launch at its start, and reads its head's constants (A_log, dt_bias, which no kernel
    writes) before it waits for the kernel before it (the in-projection that wrote q, k, v,
    a and beta). The state is read after the wait: the kernel that last wrote it (this
    layer's step for the token before) is far back in the chain, but PDL orders each kernel
    only against the one before it. Grid: (cdiv(V, BV) * B * HV,)."""
    pid = tl.program_id(0).to(tl.int64)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if PDL:
        launch_dependents()
    b_A = tl.load(A_log + i_hv).to(tl.float32)
    bias = tl.load(dt_bias + i_hv).to(tl.float32)
    if PDL:
        wait_for_the_kernel_before()
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_h = h + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    b_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + (i_n * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
    b_g = tl.load(a + i_n * HV + i_hv).to(tl.float32)
    b_g = b_g + bias
    b_g = -exp(b_A) * softplus(b_g)
    b_h *= exp(b_g)
    b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_v
    b_o = tl.sum(b_h * b_q[:, None], 0)
    p_o = o + (i_n * HV + i_hv) * V + o_v
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
