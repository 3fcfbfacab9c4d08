"""The Triton kernels behind unimax.ops.decode_attention (imported lazily: Triton is needed only
for CUDA work and the interpreter tests). Split-KV decoding over a static buffer: the length
is read on the device, so the same launch serves every step of a captured graph and reads only
the entries written so far."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    """a @ b accumulated in fp32: on the tensor cores, or (DOT_F32: Triton's CPU interpreter,
    whose BF16 dots are wrong) over the same values in fp32, exact products as theirs."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def decode_partial(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, scale, max_length,
                   KVH: tl.constexpr, G: tl.constexpr, T: tl.constexpr, RP: tl.constexpr,
                   TILES: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLITS: tl.constexpr, DOT_F32: tl.constexpr):
    """One program: RP of the T * G query rows of one KV head (row r: query token r // G, its
    head r % G; rows past T * G are padding for the tensor cores) over the key blocks split,
    split + SPLITS, ... below the tile's length (its last token's position + 1). Token t sits
    at position + t and sees keys 0..position + t. Writes the online softmax's running max m,
    its sum l and the unnormalized output (RP, D) for the combine; a row that saw no key in
    this split keeps m = -inf and l = 0 (its output is never read)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tile = pid % TILES
    bh = pid // TILES
    b = bh // KVH
    kvh = bh % KVH
    pos = tl.load(pos_ptr).to(tl.int32)
    r = tile * RP + tl.arange(0, RP)
    t = r // G
    last = pos + t  # each row's last visible key
    t_top = tl.minimum(T - 1, (tile * RP + RP - 1) // G)
    length = tl.minimum(pos + t_top + 1, max_length)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * sq_b + (kvh * G + r % G)[:, None] * sq_h + t[:, None] * sq_t
                + rd[None, :], mask=(r < T * G)[:, None], other=0.0)
    m = tl.full((RP,), float("-inf"), tl.float32)
    l_sum = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, D), tl.float32)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    for start in range(split * BLOCK_N, length, SPLITS * BLOCK_N):
        offs = start + rn
        valid = offs < length
        k = tl.load(k_base + offs[:, None] * sk_n + rd[None, :], mask=valid[:, None], other=0.0)
        s = dot(q, tl.trans(k), DOT_F32) * scale
        s = tl.where(valid[None, :] & (offs[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row with no visible key yet (a later token's keys only) stays at -inf: shift it by
        # 0 so that its exponentials are 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs[:, None] * sv_n + rd[None, :], mask=valid[:, None], other=0.0)
        # the probabilities rounded to V's dtype before the product, as flash attention does
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    idx = (pid * RP + tl.arange(0, RP)) * SPLITS + split
    tl.store(m_ptr + idx, m)
    tl.store(l_ptr + idx, l_sum)
    tl.store(acc_ptr + idx[:, None] * D + rd[None, :], acc, mask=split * BLOCK_N < length)


@triton.jit
def decode_combine(m_ptr, l_ptr, acc_ptr, o_ptr, so_b, so_h, so_t,
                   KVH: tl.constexpr, G: tl.constexpr, T: tl.constexpr, RP: tl.constexpr,
                   TILES: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """One program a (batch, query head, token): the splits' partial softmaxes rescaled to
    their common max and summed; only splits that saw a key are read (every token sees key 0,
    so at least one did)."""
    pid = tl.program_id(0)
    t = pid % T
    h = (pid // T) % (KVH * G)
    b = pid // (T * KVH * G)
    r = t * G + h % G
    row = ((b * KVH + h // G) * TILES + r // RP) * RP + r % RP
    rs = tl.arange(0, SPLITS)
    rd = tl.arange(0, D)
    m = tl.load(m_ptr + row * SPLITS + rs)
    l_sum = tl.load(l_ptr + row * SPLITS + rs)
    seen = m > float("-inf")
    top = tl.max(m, 0)
    w = tl.where(seen, tl.exp(m - top), 0.0)
    acc = tl.load(acc_ptr + (row * SPLITS + rs)[:, None] * D + rd[None, :],
                  mask=seen[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(w * l_sum, 0)
    tl.store(o_ptr + b * so_b + h * so_h + t * so_t + rd, out.to(o_ptr.dtype.element_ty))
