"""Attention over explicitly masked keys, with grouped-query heads."""

from __future__ import annotations

import torch
from torch.nn import functional as F


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
