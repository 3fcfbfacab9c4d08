"""The Triton kernels behind unimax.ops.short_recurrence and unimax.ops.block_mixer (imported
lazily: Triton is needed only for CUDA work and the interpreter tests). The launch settings and
their choice live there."""

import triton
import triton.language as tl


@triton.jit
def unit_rows(x_all):
    """Rows L2-normalized in fp32 as fla's kernel does (1e-6 inside the sqrt)."""
    return x_all / tl.sqrt(tl.sum(x_all * x_all, 1) + 1e-6)[:, None]


@triton.jit
def run_steps(h, q_all, k_all, v_all, g_all, b_all, o_ptr, rv, mask_v, c: tl.constexpr,
              T: tl.constexpr, TC: tl.constexpr, o_stride, STORE_O: tl.constexpr):
    """Tokens c .. c + TC - 1 (those below T) of the recurrence from state h (BK, BV), each
    token's row picked out of the chunk's registers; token i's output to o_ptr + i * o_stride
    + rv. Per token (fla's order): h *= exp(g); v' = beta (v - h^T k); h += k v'^T; o = h^T q.
    Without STORE_O (a rewind: the state is all it needs) o is neither computed nor stored,
    and q_all is not read; h's arithmetic is the same. Returns h."""
    rt = tl.arange(0, TC)
    for s in tl.static_range(TC):
        if c + s < T:
            row = rt == s
            b_k = tl.sum(tl.where(row[:, None], k_all, 0.0), 0)
            b_v = tl.sum(tl.where(row[:, None], v_all, 0.0), 0)
            b_g = tl.sum(tl.where(row, g_all, 0.0), 0)
            b_beta = tl.sum(tl.where(row, b_all, 0.0), 0)
            h *= tl.exp(b_g)
            b_v = b_beta * (b_v - tl.sum(h * b_k[:, None], 0))
            h += b_k[:, None] * b_v[None, :]
            if STORE_O:
                b_q = tl.sum(tl.where(row[:, None], q_all, 0.0), 0)
                b_o = tl.sum(h * b_q[:, None], 0)
                p_o = o_ptr + (c + s) * o_stride + rv
                tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
    return h


@triton.jit
def short_recurrence_kernel(q, k, v, g, beta, o, h0, ht, h_save, ht_copy, scale,
                            stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt,
                            stride_gb, stride_gt, stride_bb, stride_bt,
                            T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, TC: tl.constexpr, STORE_FINAL: tl.constexpr,
                            SAVE_INITIAL: tl.constexpr = False,
                            STORE_COPY: tl.constexpr = False, STORE_O: tl.constexpr = True):
    """The gated delta rule over T tokens for one (sequence, value head, BV columns of V):
    fla's fused recurrent kernel's arithmetic (q and k L2-normalized in fp32 with 1e-6 inside
    the sqrt, q scaled; per token h *= exp(g); v' = beta (v - h^T k); h += k v'^T;
    o = h^T q), with the loads moved out of the time loop: every token's q, k, v, g and beta
    of a chunk of TC tokens is requested at once, before the first step, and each step picks
    its row out of registers. fla's kernel loads inside its loop, so each token waits a full
    memory round trip (its output store sits between one token's loads and the next, and the
    compiler may not move loads above a store to memory it cannot tell apart): at 4B heads on
    the H200 its 9-token launch took 22 us where this one took 8.3 (ops.short_recurrence).
    Grid: (cdiv(V, BV), B * HV).

    The verifier's rewind (ops.short_recurrence.rewind_states_) also keeps the state it started
    from (SAVE_INITIAL: h0 stored to h_save) and writes the final state twice (STORE_COPY: to
    ht_copy too), so that one pass over the states replaces a snapshot and two copies. ht may
    be h0 itself: each program loads its own tile of h0 before it stores anything there, and
    no other program touches that tile."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mask_k = rk < K
    mask_v = rv < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_h = i_nh * K * V + rk[:, None] * V + rv[None, :]
    h = tl.load(h0 + p_h, mask=mask_h, other=0.0).to(tl.float32)
    if SAVE_INITIAL:
        tl.store(h_save + p_h, h, mask=mask_h)
    rt = tl.arange(0, TC)
    for c in tl.static_range(0, T, TC):
        t = c + rt
        mask_t = t < T
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        k_all = tl.load(k + i_n * stride_kb + t[:, None] * stride_kt + i_h * K + rk[None, :],
                        mask=mask_tk, other=0.0).to(tl.float32)
        k_all = unit_rows(k_all)
        if STORE_O:  # (q reaches only the outputs)
            q_all = tl.load(q + i_n * stride_qb + t[:, None] * stride_qt + i_h * K + rk[None, :],
                            mask=mask_tk, other=0.0).to(tl.float32)
            q_all = unit_rows(q_all) * scale
        else:
            q_all = k_all  # (not read)
        v_all = tl.load(v + i_n * stride_vb + t[:, None] * stride_vt + i_hv * V + rv[None, :],
                        mask=mask_tv, other=0.0).to(tl.float32)
        g_all = tl.load(g + i_n * stride_gb + t * stride_gt + i_hv, mask=mask_t,
                        other=0.0).to(tl.float32)
        b_all = tl.load(beta + i_n * stride_bb + t * stride_bt + i_hv, mask=mask_t,
                        other=0.0).to(tl.float32)
        h = run_steps(h, q_all, k_all, v_all, g_all, b_all, o + (i_n * T * HV + i_hv) * V, rv,
                      mask_v, c, T, TC, HV * V, STORE_O)
    if STORE_FINAL:
        tl.store(ht + p_h, h, mask=mask_h)
    if STORE_COPY:
        tl.store(ht_copy + p_h, h, mask=mask_h)


@triton.jit
def conv_silu(mixed, stride_mt, state, weight, t, ch, mask_t, mask_c, W: tl.constexpr):
    """SiLU of the causal conv at tokens t (TC,) and channels ch (C,), rounded to mixed's dtype:
    token t's window is [state, mixed] entries t + 1 .. t + W (the state (channels, W) holds
    the last W inputs); fp32 products summed over the window in order, SiLU in fp32 (the torch
    block form's arithmetic, ops.conv.causal_conv1d)."""
    acc = tl.zeros((t.shape[0], ch.shape[0]), dtype=tl.float32)
    for w in tl.static_range(W):
        j = t + 1 + w  # in [state, mixed]
        old = j < W
        mask = mask_t[:, None] & mask_c[None, :]
        xs = tl.load(state + ch[None, :] * W + j[:, None], mask=mask & old[:, None], other=0.0)
        xm = tl.load(mixed + (j - W)[:, None] * stride_mt + ch[None, :],
                     mask=mask & (~old)[:, None], other=0.0)
        x = tl.where(old[:, None], xs.to(xm.dtype), xm).to(tl.float32)
        acc += x * tl.load(weight + ch * W + w, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    return (acc / (1.0 + tl.exp(-acc))).to(mixed.dtype.element_ty)


@triton.jit
def tape_record_kernel(mixed, a, b, conv_state, conv_weight, A_log, dt_bias,
                       tape_x, tape_q, tape_k, tape_v, tape_g, tape_beta,
                       stride_mt, stride_at, stride_bt, stride_xt, stride_qt, stride_vt,
                       stride_gt, T,
                       KD: tl.constexpr, CD: tl.constexpr, HV: tl.constexpr,
                       W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
                       NEG_EIGVAL: tl.constexpr):
    """What a recording GDN mixer writes to the tape over T tokens of one sequence, for BC of
    its CD conv channels: the raw conv input, and the convolution with SiLU (rounded as the
    torch forms round) into q (channels 0 .. KD - 1), k (KD .. 2 KD - 1) or v (the rest);
    program 0 also the gates of all HV heads, g = -exp(A_log) softplus(a + dt_bias) in fp32
    and beta = sigmoid(b) rounded to b's dtype (doubled with NEG_EIGVAL). No recurrence: the
    verify block's and the rewind's recurrences both read these values back through one kernel
    (ops.short_recurrence), so a state comes out bit for bit the same whichever block boundary
    it was computed across. T is a runtime argument (BT, its power of two, sizes the tile): one
    compile per bucket of block lengths, not per length. Grid: (cdiv(CD, BC),)."""
    pid = tl.program_id(0)
    ch = pid * BC + tl.arange(0, BC)
    t = tl.arange(0, BT)
    mask_c = ch < CD
    mask_t = t < T
    m = mask_t[:, None] & mask_c[None, :]
    y = conv_silu(mixed, stride_mt, conv_state, conv_weight, t, ch, mask_t, mask_c, W)
    raw = tl.load(mixed + t[:, None] * stride_mt + ch[None, :], mask=m, other=0.0)
    tl.store(tape_x + t[:, None] * stride_xt + ch[None, :], raw, mask=m)
    store_qkv(tape_q, tape_k, tape_v, y, t, ch, m, stride_qt, stride_vt, KD)
    if pid == 0:
        rh = tl.arange(0, BH)
        mh = mask_t[:, None] & (rh < HV)[None, :]
        a_t = tl.load(a + t[:, None] * stride_at + rh[None, :], mask=mh, other=0.0)
        b_t = tl.load(b + t[:, None] * stride_bt + rh[None, :], mask=mh, other=0.0)
        A = tl.load(A_log + rh, mask=rh < HV, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias + rh, mask=rh < HV, other=0.0).to(tl.float32)
        g = decay_of(a_t, A[None, :], bias[None, :])
        beta = beta_of(b_t, NEG_EIGVAL)
        gates = t[:, None] * stride_gt + rh[None, :]
        tl.store(tape_g + gates, g, mask=mh)
        tl.store(tape_beta + gates, beta, mask=mh)


@triton.jit
def decay_of(a_t, A, bias):
    """The mixer's log-decay from its raw a: -exp(A_log) softplus(a + dt_bias), in fp32 (the
    torch forms' arithmetic, ops.decode_step.decay)."""
    x = a_t.to(tl.float32) + bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold 20
    return -tl.exp(A) * softplus


@triton.jit
def beta_of(b_t, NEG_EIGVAL: tl.constexpr):
    """The mixer's write strength from its raw b: sigmoid(b) rounded to b's dtype (doubled
    with NEG_EIGVAL, rounded again: ops.decode_step.write_strength)."""
    beta = (1.0 / (1.0 + tl.exp(-b_t.to(tl.float32)))).to(b_t.dtype)
    if NEG_EIGVAL:
        beta = (beta.to(tl.float32) * 2.0).to(b_t.dtype)
    return beta


@triton.jit
def store_qkv(tape_q, tape_k, tape_v, y, t, ch, m, stride_qt, stride_vt, KD: tl.constexpr):
    """The convolution's output y (tokens t, conv channels ch; where m) into the tape's q
    (channels below KD), k (the next KD) or v (the rest)."""
    row = t[:, None] * stride_qt
    tl.store(tape_q + row + ch[None, :], y, mask=m & (ch < KD)[None, :])
    tl.store(tape_k + row + (ch - KD)[None, :], y, mask=m & ((ch >= KD) & (ch < 2 * KD))[None, :])
    tl.store(tape_v + t[:, None] * stride_vt + (ch - 2 * KD)[None, :], y,
             mask=m & (ch >= 2 * KD)[None, :])
