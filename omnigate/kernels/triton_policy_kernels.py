"""Triton kernels for the robot policy's action expert: attention of the action tokens over the cached prefix (split
over the keys, in the manner of flash decoding) and Gemma's ``gelu_tanh(gate) * up``. Imported only where Triton is
installed; :mod:`omnigate.kernels.prefix_attention` and :mod:`omnigate.kernels.gelu_mul` choose between these and
their references.
"""

# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

# What a GPU too small for a kernel's blocks raises at its first launch (the shared memory or registers it needs).
KERNEL_UNFIT = (OutOfResources, CompilationError)

# Programs the split-KV attention aims to launch per call: enough for every multiprocessor to hold two.
_PROGRAMS_PER_SM = 2


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the combine is exercised
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# ---- attention over the cached prefix ------------------------------------------------------------------------------


@triton.jit
def _prefix_attention_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    q_batch_stride,
    q_token_stride,
    q_head_stride,
    k_batch_stride,
    k_pos_stride,
    v_batch_stride,
    v_pos_stride,
    bias_batch_stride,
    rows,
    keys,
    heads,
    chunk,
    scale_log2,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.program_id(2)
    r = block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: token r // heads, head r % heads
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    row_ok = r < rows
    q_rows = q_ptr + batch * q_batch_stride + (r // heads) * q_token_stride + (r % heads) * q_head_stride
    q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + batch * k_batch_stride
    v_base = v_ptr + batch * v_batch_stride
    bias_base = bias_ptr + batch * bias_batch_stride
    # A finite floor: a block whose keys are all masked gives exp2(-inf - floor) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, keys)
    for first in range(start, end, BLOCK_N):
        pos = first + n
        pos_ok = pos < end
        k = tl.load(k_base + pos[:, None] * k_pos_stride + d[None, :], mask=pos_ok[:, None], other=0.0)
        bias = tl.load(bias_base + pos, mask=pos_ok, other=float("-inf"))
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else "tf32") * scale_log2
        s = s + bias[None, :] * 1.4426950408889634  # the additive mask, in log2 units as the scores
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None] * v_pos_stride + d[None, :], mask=pos_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else "tf32")
        m_i = m_new
    seen = l_i > 0.0
    denominator = tl.where(seen, l_i, 1.0)
    out = acc / denominator[:, None]
    if SPLITS == 1:
        dst = out_ptr + (batch * rows + r)[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        slot = (batch * SPLITS + split) * rows + r
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
        tl.store(lse_ptr + slot, tl.where(seen, m_i + tl.log2(denominator), float("-inf")), mask=row_ok)


@triton.jit
def _prefix_attention_combine_kernel(
    part_ptr, lse_ptr, out_ptr, rows, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr
):
    block = tl.program_id(0)
    batch = tl.program_id(1)
    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row_ok = r < rows
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in tl.static_range(SPLITS):
        lse = tl.load(lse_ptr + (batch * SPLITS + split) * rows + r, mask=row_ok, other=float("-inf"))
        top = tl.maximum(top, lse)
    top = tl.where(row_ok, top, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for split in tl.static_range(SPLITS):
        slot = (batch * SPLITS + split) * rows + r
        weight = tl.exp2(tl.load(lse_ptr + slot, mask=row_ok, other=float("-inf")) - top)
        part = tl.load(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
        acc += weight[:, None] * part
        total += weight
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    dst = out_ptr + (batch * rows + r)[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefix_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_bias: torch.Tensor,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 8,
) -> torch.Tensor:
    """See :func:`omnigate.kernels.prefix_attention.prefix_attention`. The keys are cut into as many chunks as keep
    the GPU's multiprocessors busy for this batch (none for a large batch); each program takes ``block_m`` query rows
    over one chunk and writes its normalized partial output and log-sum-exp, and a second kernel combines them."""
    batch, tokens, heads, head_dim = query.shape
    rows, length = tokens * heads, keys.shape[1]
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    row_blocks = triton.cdiv(rows, block_m)
    key_blocks = triton.cdiv(length, block_n)
    wanted = _PROGRAMS_PER_SM * _multiprocessors(query.device) // (batch * row_blocks)
    splits = max(1, min(key_blocks, wanted))
    chunk = triton.cdiv(key_blocks, splits) * block_n
    splits = triton.cdiv(length, chunk)  # no empty chunk
    out = torch.empty((batch, tokens, heads * head_dim), device=query.device, dtype=query.dtype)
    if splits > 1:
        part = torch.empty((batch, splits, rows, head_dim), device=query.device, dtype=torch.float32)
        lse = torch.empty((batch, splits, rows), device=query.device, dtype=torch.float32)
    else:
        part = lse = out  # unused: the one chunk writes the output
    scale_log2 = head_dim**-0.5 * 1.4426950408889634
    _prefix_attention_partial_kernel[(row_blocks, splits, batch)](
        query,
        keys,
        values,
        key_bias,
        out,
        part,
        lse,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        key_bias.stride(0),
        rows,
        length,
        heads,
        chunk,
        scale_log2,
        SPLITS=splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        IEEE=query.dtype == torch.float32,
        num_warps=num_warps,
    )
    if splits > 1:
        combine_rows = 16
        _prefix_attention_combine_kernel[(triton.cdiv(rows, combine_rows), batch)](
            part, lse, out, rows, SPLITS=splits, BLOCK_M=combine_rows, HEAD_DIM=head_dim, num_warps=4
        )
    return out


# ---- gelu_tanh(gate) * up ------------------------------------------------------------------------------------------


@triton.jit
def _gelu_tanh_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    gelu = (0.5 * gate * (1.0 + tanh)).to(up.dtype)  # F.gelu rounds to the tensor dtype before the product
    out = gelu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`omnigate.kernels.gelu_mul.gelu_tanh_mul`."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    out = torch.empty((rows.shape[0], n), device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _gelu_tanh_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, out, n, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*gate_up.shape[:-1], n)
