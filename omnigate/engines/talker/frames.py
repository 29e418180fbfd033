"""CSM frame generation over slot caches: extend a stream's context, then sample one codec frame per stream.

The backbone reads a sequence of text-token and audio-frame embeddings and predicts codebook 0 of the next frame
from its last hidden state; the depth decoder then predicts codebooks 1..N-1 one after another, starting from that
hidden state and codebook 0. Both run batched over all streams of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnigate.engines.talker.model import TalkerModel
from omnigate.engines.talker.sampling import TokenSampler
from omnigate.engines.talker.slot_decoder import SlotDecoder


class FrameModel:
    """The CSM backbone with a slot cache for ``max_slots`` streams, and its depth decoder for ``max_batch`` rows."""

    def __init__(
        self,
        model: TalkerModel,
        *,
        max_slots: int,
        max_batch: int,
        capacity: int,
        sampler: TokenSampler,
    ) -> None:
        csm = model.csm
        config = csm.config
        self.device: torch.device = csm.lm_head.weight.device
        self.dtype: torch.dtype = csm.lm_head.weight.dtype
        self.num_codebooks = int(config.num_codebooks)
        self.vocab_size = int(config.vocab_size)
        self.eos_id = int(config.codebook_eos_token_id)
        self.max_batch = max_batch
        self.sampler = sampler
        self._text_embeddings = csm.embed_text_tokens
        self._frame_embeddings = csm.backbone_model.embed_tokens
        self._codebook0_head = csm.lm_head
        backbone = csm.backbone_model
        self.backbone = SlotDecoder(backbone.layers, backbone.norm, backbone.rotary_emb, config)
        self.cache = self.backbone.new_cache(slots=max_slots, capacity=capacity, device=self.device, dtype=self.dtype)
        depth = csm.depth_decoder.model
        self.depth = SlotDecoder(depth.layers, depth.norm, depth.rotary_emb, depth.config)
        self._depth_embeddings = depth.embed_tokens
        self._depth_projector = depth.inputs_embeds_projector
        self._depth_heads: torch.Tensor = csm.depth_decoder.codebooks_head.weight  # [N-1, hidden, vocab]
        self._depth_cache = self.depth.new_cache(
            slots=max_batch, capacity=self.num_codebooks, device=self.device, dtype=self.dtype
        )
        self._depth_rows = list(range(max_batch))

    def embed_text(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[T, hidden]`` embeddings of text tokens."""
        ids = torch.tensor(list(token_ids), device=self.device)
        out: torch.Tensor = self._text_embeddings(ids)
        return out

    def embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` embeddings of ``[..., N]`` codec frames (the sum of one embedding per codebook)."""
        flat = frames.reshape(-1, 1, self.num_codebooks)  # the embedding sums over dim 2 of [B, T, N]
        out: torch.Tensor = self._frame_embeddings(flat)
        return out.reshape(*frames.shape[:-1], out.shape[-1])

    def end_of_audio(self) -> torch.Tensor:
        """The frame that closes a segment's audio: every codebook at the end-of-audio id."""
        return torch.full((self.num_codebooks,), self.eos_id, device=self.device, dtype=torch.long)

    @torch.no_grad()
    def extend(self, slot: int, embeddings: torch.Tensor) -> torch.Tensor:
        """Append ``[T, hidden]`` embeddings to ``slot``'s context; returns the last position's hidden state."""
        batch = self.cache.batch([slot], embeddings.shape[0])
        hidden = self.backbone(embeddings.unsqueeze(0).to(self.dtype), self.cache, batch)
        return hidden[:, -1]

    @torch.no_grad()
    def advance(self, slots: Sequence[int], frames: torch.Tensor) -> torch.Tensor:
        """Append each slot's last frame (``[B, N]``); returns ``[B, hidden]`` hidden states."""
        batch = self.cache.batch(slots, 1)
        hidden = self.backbone(self.embed_frames(frames).unsqueeze(1), self.cache, batch)
        return hidden[:, 0]

    @torch.no_grad()
    def sample(self, hidden: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """Sample the next frame ``[B, N]`` of each row from its backbone hidden state ``[B, hidden]``.

        Draw ``counters[b] + i`` samples codebook ``i`` of row ``b``.
        """
        rows = hidden.shape[0]
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows exceed the depth decoder batch of {self.max_batch}")
        codes = [self.sampler(self.codebook0_logits(hidden), seeds, counters)]
        for row in self._depth_rows[:rows]:
            self._depth_cache.reset(row)
        slots = self._depth_rows[:rows]
        first = self._depth_embeddings(codes[0])
        x = torch.stack((hidden, first), dim=1)
        for i in range(1, self.num_codebooks):
            batch = self._depth_cache.batch(slots, x.shape[1])
            out = self.depth(self._depth_projector(x), self._depth_cache, batch)
            logits = out[:, -1] @ self._depth_heads[i - 1]
            codes.append(self.sampler(logits, seeds, counters + i))
            x = self._depth_embeddings(codes[i] + i * self.vocab_size).unsqueeze(1)
        return torch.stack(codes, dim=1)

    def codebook0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Backbone logits ``[..., vocab]`` for codebook 0."""
        out: torch.Tensor = self._codebook0_head(hidden)
        return out
