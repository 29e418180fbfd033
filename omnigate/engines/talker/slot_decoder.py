"""The Llama-style decoder stack of CSM (backbone or depth decoder) run over a slot cache.

It reuses the transformers modules' weights and pieces (projections, RMSNorm, MLP, rotary tables); only the
attention bookkeeping differs from the reference forward: keys go to each row's slot and every row attends over its
own history, so rows at different lengths share one batched forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from omnigate.engines.talker.kv_slots import SlotBatch, SlotKVCache
from omnigate.kernels.attention import masked_attention
from omnigate.kernels.rope import apply_rope


class SlotDecoder:
    """Runs ``layers`` then ``norm`` on new tokens of a batch of slots."""

    def __init__(self, layers: Sequence[Any], norm: nn.Module, rotary: nn.Module, config: Any) -> None:
        self.layers = list(layers)
        self.norm = norm
        self.rotary = rotary
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)

    def new_cache(self, *, slots: int, capacity: int, device: torch.device, dtype: torch.dtype) -> SlotKVCache:
        """A slot cache shaped for this stack."""
        return SlotKVCache(
            layers=len(self.layers),
            slots=slots,
            capacity=capacity,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            device=device,
            dtype=dtype,
        )

    def __call__(self, x: torch.Tensor, cache: SlotKVCache, batch: SlotBatch) -> torch.Tensor:
        """``x`` is ``[B, T, hidden]`` (the new tokens of each row); returns the normed ``[B, T, hidden]``."""
        cos, sin = self.rotary(x, batch.positions)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, cache, batch)
        cache.commit(batch)
        out: torch.Tensor = self.norm(x)
        return out

    def _layer(
        self,
        i: int,
        layer: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: SlotKVCache,
        batch: SlotBatch,
    ) -> torch.Tensor:
        rows, steps, _ = x.shape
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_proj(h).view(rows, steps, self.heads, self.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(h).view(rows, steps, self.kv_heads, self.head_dim), cos, sin)
        v = attn.v_proj(h).view(rows, steps, self.kv_heads, self.head_dim)
        keys, values = cache.append(i, batch, k, v)
        x = x + attn.o_proj(masked_attention(q, keys, values, batch.allowed, float(attn.scaling)))
        mlp_out: torch.Tensor = layer.mlp(layer.post_attention_layernorm(x))
        return x + mlp_out
