"""Attention with grouped-query heads: over explicitly masked keys, and decode attention over slot caches."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from omnigate.kernels.backend import triton_kernels, use_triton


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention where ``allowed[b, t, s]`` says whether query ``t`` of row ``b`` may see key ``s``.

    ``query`` is ``[B, T, H, D]``; ``key`` and ``value`` are ``[B, S, Hkv, D]`` with ``H`` a multiple of ``Hkv``
    (grouped-query attention). Every query must be allowed at least one key. Returns ``[B, T, H * D]``.
    """
    batch, steps, heads, head_dim = query.shape
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=allowed.unsqueeze(1),
        scale=scale,
        enable_gqa=heads != key.shape[2],
    )
    return out.transpose(1, 2).reshape(batch, steps, heads * head_dim)


def slot_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per row over the first ``lengths[r]`` keys of cache slot ``slots[r]``.

    ``query`` is ``[R, H, D]``; the caches are ``[slots, capacity, Hkv, D]``; returns ``[R, H * D]``. Reads only up to
    the longest length in the batch (a host read of ``lengths``).
    """
    slot_ids = slots.tolist()
    if len(set(slot_ids)) < len(slot_ids):
        return _grouped_slot_attention(query, key_cache, value_cache, slot_ids, lengths, scale)
    span = int(lengths.max())
    keys = key_cache[slots, :span]
    values = value_cache[slots, :span]
    allowed = torch.arange(span, device=query.device)[None, None, :] < lengths[:, None, None]
    return masked_attention(query.unsqueeze(1), keys, values, allowed, scale)[:, 0]


def _grouped_slot_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_ids: list[int],
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`slot_attention_reference` for rows of which several share a slot (a prefill): the rows of each slot
    attend over one read of its keys, instead of a copy of them per row (quadratic in a prompt's length)."""
    out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
    for slot in dict.fromkeys(slot_ids):
        rows = torch.tensor([r for r, s in enumerate(slot_ids) if s == slot], device=query.device)
        row_lengths = lengths.index_select(0, rows)
        span = int(row_lengths.max())
        allowed = torch.arange(span, device=query.device)[None, :] < row_lengths[:, None]
        keys, values = key_cache[slot, :span], value_cache[slot, :span]
        attended = masked_attention(query.index_select(0, rows)[None], keys[None], values[None], allowed[None], scale)
        out.index_copy_(0, rows, attended[0])
    return out


def slot_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`slot_attention_reference` as one Triton kernel on CUDA: each (row, key/value head) program streams its
    own slot's keys up to that row's length (online softmax), so no row pays for a longer neighbour and nothing
    waits on the host; safe inside a CUDA graph."""
    if use_triton(query) and query.is_contiguous() and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1:
        out: torch.Tensor = triton_kernels().slot_attention(query, key_cache, value_cache, slots, lengths, scale)
        return out
    return slot_attention_reference(query, key_cache, value_cache, slots, lengths, scale)
