"""Rotary position embedding (the half-split layout), alone or fused with the key/value write of a decode step."""

from __future__ import annotations

import torch

from omnigate.kernels.backend import triton_kernels, use_triton


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[B, T, H, D]``) by ``cos``/``sin`` tables of shape ``[B, T, D]`` (the half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def rope_store_reference(
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
    """Split a fused projection ``qkv`` (``[R, (heads + 2 * kv_heads) * D]``, one row per token) into q, k and v,
    rotate q and k by ``cos``/``sin`` (``[R, D]``), write k and v at ``[slots[r], positions[r]]`` of the caches
    (``[slots, capacity, kv_heads, D]``) and return the rotated queries ``[R, heads, D]``."""
    rows = qkv.shape[0]
    head_dim = key_cache.shape[-1]
    q, k, v = torch.split(qkv.view(rows, heads + 2 * kv_heads, head_dim), [heads, kv_heads, kv_heads], dim=1)
    q = apply_rope(q.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1)).squeeze(1)
    k = apply_rope(k.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1)).squeeze(1)
    key_cache[slots, positions] = k.to(key_cache.dtype)
    value_cache[slots, positions] = v.to(value_cache.dtype)
    return q


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
    """:func:`rope_store_reference` in one Triton kernel on CUDA."""
    if use_triton(qkv) and qkv.stride(-1) == 1 and key_cache.stride(-1) == 1 and cos.stride(-1) == 1:
        out: torch.Tensor = triton_kernels().rope_store(
            qkv, cos, sin, key_cache, value_cache, slots, positions, heads, kv_heads
        )
        return out
    return rope_store_reference(qkv, cos, sin, key_cache, value_cache, slots, positions, heads, kv_heads)
