"""Moshi's depth transformer: the audio codebooks of one frame, one after another, batched across sessions.

Codebook ``k`` reads the temporal transformer's hidden state (through a per-codebook projection) plus the embedding
of the token before it (the text token for codebook 0); every linear layer has one weight per codebook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

Sample = Callable[[torch.Tensor, int], torch.Tensor]
"""Draws codebook ``k``'s ids ``[B]`` from its logits ``[B, vocab]``."""


class DepthSampler:
    """Samples the ``K`` audio codes of a frame from a ``MoshiDepthDecoder``."""

    def __init__(self, depth: Any, num_codebooks: int) -> None:
        config = depth.config
        self.num_codebooks = num_codebooks
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.layers: list[Any] = list(depth.layers)
        self.text_embeddings: Any = depth.text_embed_tokens
        self.audio_embeddings: list[Any] = list(depth.embed_tokens)
        self.input_projections: Any = depth.input_projections
        self.heads_out: Any = depth.lm_heads
        self.device: torch.device = next(depth.parameters()).device
        self._codebook = [torch.tensor([k], device=self.device) for k in range(num_codebooks)]

    @torch.no_grad()
    def sample(self, hidden: torch.Tensor, text: torch.Tensor, draw: Sample) -> torch.Tensor:
        """``[B, K]`` codes of one frame from ``[B, hidden]`` temporal states and the ``[B]`` text ids just drawn."""
        batch = hidden.shape[0]
        context = hidden[:, None, :]
        token = self.text_embeddings(text[:, None])
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.layers]
        codes: list[torch.Tensor] = []
        for k in range(self.num_codebooks):
            index = self._codebook[k]
            x = (token + self.input_projections(context, index)).to(hidden.dtype)
            for i, layer in enumerate(self.layers):
                x = self._layer(layer, x, index, keys[i], values[i], batch)
            logits = self.heads_out(x, index)[:, 0]
            code = draw(logits, k)
            codes.append(code)
            if k + 1 < self.num_codebooks:
                token = self.audio_embeddings[k](code[:, None])
        return torch.stack(codes, dim=1)

    def _layer(
        self,
        layer: Any,
        x: torch.Tensor,
        index: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        batch: int,
    ) -> torch.Tensor:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h, index).view(batch, 1, self.heads, self.head_dim)
        keys.append(attn.k_proj(h, index).view(batch, 1, self.kv_heads, self.head_dim))
        values.append(attn.v_proj(h, index).view(batch, 1, self.kv_heads, self.head_dim))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            torch.cat(keys, dim=1).transpose(1, 2),
            torch.cat(values, dim=1).transpose(1, 2),
            scale=float(attn.scaling),
            enable_gqa=self.heads != self.kv_heads,
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1), index)
        mlp_out: torch.Tensor = layer.mlp(layer.post_attention_layernorm(x), index)
        return x + mlp_out
