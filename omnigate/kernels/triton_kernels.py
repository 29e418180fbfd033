"""Triton kernels for the talker's per-step hot path. Each one computes what its plain-torch reference computes
(see the op modules beside this one), rounding to the tensor dtype where the reference rounds, so the two agree to
within a unit in the last place. Imported only where Triton is installed; the op modules choose between this and the
reference.
"""

# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnigate.kernels.sampling_types import SamplingRows, Vocabulary


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(n))


# ---- RMSNorm -------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_stride, out_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_raw = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(x_raw.dtype)  # the reference rounds to the input dtype here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (rows contiguous)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, n, rows.stride(0), out.stride(0), eps, BLOCK=_pow2(n), num_warps=8 if n >= 2048 else 4
    )
    return out.view(*x.shape[:-1], n)


# ---- SiLU(gate) * up -----------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # F.silu rounds to the tensor dtype before the product
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., 2 * n]`` holding gate then up."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    out = torch.empty((rows.shape[0], n), device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, out, n, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*gate_up.shape[:-1], n)


# ---- rotary embedding of q and k, and the key/value write into a slot cache ----------------------------------------


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    pos_ptr,
    qkv_stride,
    cs_stride,
    q_row_stride,
    k_slot_stride,
    k_pos_stride,
    v_slot_stride,
    v_pos_stride,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # query heads first, then key/value heads
    d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + row * cs_stride + d).to(tl.float32)
    c2 = tl.load(cos_ptr + row * cs_stride + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + row * cs_stride + d).to(tl.float32)
    s2 = tl.load(sin_ptr + row * cs_stride + HALF + d).to(tl.float32)
    src = qkv_ptr + row * qkv_stride + head * 2 * HALF
    x1_raw = tl.load(src + d)
    x2_raw = tl.load(src + HALF + d)
    dt = x1_raw.dtype
    x1 = x1_raw.to(tl.float32)
    x2 = x2_raw.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the tensor dtype as torch does
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    if head < HEADS:
        dst = q_out_ptr + row * q_row_stride + head * 2 * HALF
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    else:
        kv = head - HEADS
        slot = tl.load(slot_ptr + row)
        pos = tl.load(pos_ptr + row)
        k_dst = k_cache_ptr + slot * k_slot_stride + pos * k_pos_stride + kv * 2 * HALF
        tl.store(k_dst + d, o1.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_dst + HALF + d, o2.to(k_cache_ptr.dtype.element_ty))
        v_src = qkv_ptr + row * qkv_stride + (HEADS + KV_HEADS + kv) * 2 * HALF
        v_dst = v_cache_ptr + slot * v_slot_stride + pos * v_pos_stride + kv * 2 * HALF
        tl.store(v_dst + d, tl.load(v_src + d).to(v_cache_ptr.dtype.element_ty))
        tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d).to(v_cache_ptr.dtype.element_ty))


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """See :func:`omnigate.kernels.rope.rope_store`."""
    rows = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    q = torch.empty((rows, heads, head_dim), device=qkv.device, dtype=qkv.dtype)
    _rope_store_kernel[(rows, heads + kv_heads)](
        qkv,
        cos,
        sin,
        q,
        key_cache,
        value_cache,
        slots,
        positions,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=head_dim // 2,
        num_warps=1,
    )
    return q


# ---- decode attention over slot caches with per-row lengths ------------------------------------------------------


@triton.jit
def _slot_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    len_ptr,
    out_ptr,
    scale,
    q_row_stride,
    k_slot_stride,
    k_pos_stride,
    v_slot_stride,
    v_pos_stride,
    out_row_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    length = tl.load(len_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None], other=0.0)
    k_base = k_ptr + slot * k_slot_stride + kv_head * HEAD_DIM
    v_base = v_ptr + slot * v_slot_stride + kv_head * HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        keys = start + n
        k_mask = keys < length
        k = tl.load(k_base + keys[:, None] * k_pos_stride + d[None, :], mask=k_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32")
        s = tl.where(k_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + keys[:, None] * v_pos_stride + d[None, :], mask=k_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else "tf32")
        m_i = m_new
    out = acc / l_i[:, None]
    dst = out_ptr + row * out_row_stride + heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def slot_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See :func:`omnigate.kernels.attention.slot_attention`."""
    rows, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty((rows, heads * head_dim), device=query.device, dtype=query.dtype)
    _slot_attention_kernel[(rows, kv_heads)](
        query,
        key_cache,
        value_cache,
        slots,
        lengths,
        out,
        scale,
        query.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        out.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, _pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=64,
        IEEE=query.dtype == torch.float32,
        num_warps=4,
    )
    return out


# ---- sampling: penalty, temperature, top-k, top-p and seeded Gumbel-max in one pass per row -----------------------


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _order_key(x):
    # An int32 whose order is the float order: negative floats get their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _sample_kernel(
    logits_ptr,
    logits_stride,
    out_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    penalty_ptr,
    seed_ptr,
    counter_ptr,
    hist_ptr,
    hist_slot_stride,
    hist_slot_ptr,
    ring_ptr,
    draw,
    valid,
    eos_id,
    eos_bias,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    in_vocab = offs < valid
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=in_vocab, other=0.0).to(tl.float32)
    x = tl.where(offs == eos_id, x + eos_bias, x)
    if WINDOW > 0:
        penalty = tl.load(penalty_ptr + row)
        hist = hist_ptr + tl.load(hist_slot_ptr + row) * hist_slot_stride
        seen = offs < 0
        for w in tl.static_range(WINDOW):
            seen = seen | (offs == tl.load(hist + w))
        x = tl.where(seen, tl.where(x > 0, x / penalty, x * penalty), x)
    x = tl.where(in_vocab, x, float("-inf"))
    greedy = tl.argmax(x, axis=0)

    temp = tl.load(temp_ptr + row)
    s = x / tl.where(temp > 0, temp, 1.0)
    key = _order_key(s)

    # top-k: the k-th largest key, found exactly by bisection over the 32-bit key range
    k = tl.load(top_k_ptr + row)
    k = tl.where((k > 0) & (k < valid), k, valid)
    lo = tl.min(tl.where(in_vocab, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(in_vocab, key, -2147483648), axis=0).to(tl.int64) + 1
    for _ in range(33):
        mid = (lo + hi) >> 1
        count = tl.sum(tl.where(in_vocab & (key >= mid), 1, 0), axis=0)
        ok = count >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    keep = in_vocab & (key >= lo)

    # top-p: the highest key whose tokens at or above it hold at least top_p of the (top-k) probability
    top_p = tl.load(top_p_ptr + row)
    target = tl.where(top_p < 1.0, top_p, 2.0)  # above any mass: nothing is cut
    peak = tl.max(tl.where(keep, s, float("-inf")), axis=0)
    weight = tl.where(keep, tl.exp(s - peak), 0.0)
    prob = weight / tl.sum(weight, axis=0)
    lo = tl.min(tl.where(keep, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(keep, key, -2147483648), axis=0).to(tl.int64) + 1
    for _ in range(33):
        mid = (lo + hi) >> 1
        mass = tl.sum(tl.where(keep & (key >= mid), prob, 0.0), axis=0)
        ok = mass >= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    keep = keep & (key >= lo)

    # Gumbel-max with noise hashed from (seed, draw counter, token id), as omnigate.kernels.sampling.uniform_noise
    seed = tl.load(seed_ptr + row)
    counter = tl.load(counter_ptr + row) + draw
    seed32 = ((seed ^ (seed >> 32)) & 0xFFFFFFFF).to(tl.uint32)
    row_hash = _mix32(((_mix32(seed32).to(tl.int64) + counter) & 0xFFFFFFFF).to(tl.uint32))
    token_hash = _mix32(offs.to(tl.uint32) + 0x9E3779B9)
    bits = _mix32(row_hash ^ token_hash) >> 8
    u = (bits.to(tl.float32) + 0.5) / 16777216.0
    gumbel = -tl.log(-tl.log(u))
    sampled = tl.argmax(tl.where(keep, s + gumbel, float("-inf")), axis=0)
    token = tl.where(temp > 0, sampled, greedy).to(tl.int64)
    tl.store(out_ptr + row, token)
    if WINDOW > 0:
        tl.store(hist + tl.load(ring_ptr + row), token)


def sample_tokens(
    logits: torch.Tensor, rows: SamplingRows, history: torch.Tensor, draw: int, vocab: Vocabulary
) -> torch.Tensor:
    """See :func:`omnigate.kernels.sampling.sample_tokens`."""
    count = logits.shape[0]
    out = torch.empty(count, device=logits.device, dtype=torch.int64)
    _sample_kernel[(count,)](
        logits,
        logits.stride(0),
        out,
        rows.temperature,
        rows.top_k,
        rows.top_p,
        rows.penalty,
        rows.seeds,
        rows.counters,
        history,
        history.stride(0),
        rows.history_slots,
        rows.ring,
        draw,
        vocab.valid_ids,
        vocab.eos_id,
        vocab.eos_bias,
        WINDOW=history.shape[-1],
        BLOCK=_pow2(vocab.valid_ids),
        num_warps=8,
    )
    return out


# ---- float audio to s16 PCM, per-row RMS and a flag, packed for one host copy ------------------------------------


@triton.jit
def _pack_pcm_kernel(audio_ptr, audio_stride, flag_ptr, out_ptr, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(audio_ptr + row * audio_stride + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.minimum(tl.maximum(a, -1.0), 1.0)
    rms = tl.sqrt(tl.sum(a * a, axis=0) / n)
    y = a * 32767.0
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    rounded = tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))  # half to even, as torch.round
    dst = out_ptr + row * out_stride
    tl.store(dst + offs, rounded.to(tl.int32).to(tl.int16), mask=mask)
    rms_bits = rms.to(tl.int32, bitcast=True)
    tl.store(dst + n, (rms_bits & 0xFFFF).to(tl.int16))
    tl.store(dst + n + 1, ((rms_bits >> 16) & 0xFFFF).to(tl.int16))
    tl.store(dst + n + 2, tl.where(tl.load(flag_ptr + row) != 0, 1, 0).to(tl.int16))


def pack_pcm(audio: torch.Tensor, flags: torch.Tensor, out: torch.Tensor) -> None:
    """See :func:`omnigate.kernels.pcm.pack_pcm`."""
    rows, n = audio.shape
    _pack_pcm_kernel[(rows,)](audio, audio.stride(0), flags, out, out.stride(0), n, BLOCK=_pow2(n), num_warps=4)
