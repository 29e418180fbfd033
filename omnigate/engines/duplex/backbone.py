"""Moshi's temporal transformer stepped one frame at a time over a ring cache, batched across sessions.

Each step reads one embedding per session (its last text token, the model's last audio codes and the user's audio
codes, summed) and returns the hidden state the text head and the depth transformer read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from omnigate.engines.duplex.ring_cache import RingKVCache, RingStep
from omnigate.kernels.attention import masked_attention
from omnigate.kernels.rope import apply_rope


class SlotBackbone:
    """The temporal transformer of a ``MoshiForConditionalGeneration`` with a window of ``window`` steps per slot."""

    def __init__(self, moshi: Any, *, slots: int, window: int) -> None:
        config = moshi.config
        decoder = moshi.decoder.model
        param = next(decoder.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.num_codebooks = int(config.num_codebooks)
        self.vocab_size = int(config.vocab_size)
        self.audio_vocab_size = int(config.audio_vocab_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.layers: list[Any] = list(decoder.layers)
        self.norm: Any = decoder.norm
        self.text_embeddings: Any = decoder.embed_tokens
        self.text_head: Any = moshi.decoder.lm_head
        self.rotary: Any = self.layers[0].self_attn.rotary_emb
        # The 2 * K audio embedding tables (model stream, then user stream) as one table, so a step embeds all
        # codes with one lookup instead of one per codebook.
        tables = [embedding.weight for embedding in moshi.embed_tokens]
        self.audio_table = torch.cat(tables).detach()
        rows = self.audio_vocab_size + 1
        self.audio_offsets = torch.arange(len(tables), device=self.device) * rows
        self.cache = RingKVCache(
            layers=len(self.layers),
            slots=slots,
            window=window,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            device=self.device,
            dtype=self.dtype,
        )

    def embed(self, text: torch.Tensor, model_codes: torch.Tensor, user_codes: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` input of one step from ``[B]`` text ids and ``[B, K]`` model and user audio codes."""
        codes = torch.cat((model_codes, user_codes), dim=1) + self.audio_offsets[None, :]
        audio = F.embedding(codes, self.audio_table).sum(dim=1)
        out: torch.Tensor = self.text_embeddings(text) + audio
        return out

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: RingStep) -> torch.Tensor:
        """Advance each row of ``step`` by the ``[B, hidden]`` input ``x``; returns normed ``[B, hidden]`` states."""
        out = self.layers_forward(x, step)
        self.cache.commit(step)
        return out

    def layers_forward(self, x: torch.Tensor, step: RingStep) -> torch.Tensor:
        """The device work of :meth:`forward` (it writes the step into the cache but does not count it): with the
        step's tensors in fixed buffers it can be captured in a CUDA graph and replayed."""
        h = x[:, None, :].to(self.dtype)
        cos, sin = self.rotary(h, step.positions[:, None])
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cos, sin, step)
        out: torch.Tensor = self.norm(h)[:, 0]
        return out

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.text_head(hidden)
        return out

    def _layer(
        self, i: int, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: RingStep
    ) -> torch.Tensor:
        batch = x.shape[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_proj(h).view(batch, 1, self.heads, self.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(h).view(batch, 1, self.kv_heads, self.head_dim), cos, sin)
        v = attn.v_proj(h).view(batch, 1, self.kv_heads, self.head_dim)
        keys, values = self.cache.write(i, step, k[:, 0], v[:, 0])
        out = masked_attention(q, keys, values, step.allowed, float(attn.scaling))
        x = x + attn.o_proj(out)
        mlp_out: torch.Tensor = layer.mlp(layer.post_attention_layernorm(x))
        return x + mlp_out
