"""CSM frame generation over slot caches: extend a stream's context, then sample one codec frame per stream.

The backbone reads a sequence of text-token and audio-frame embeddings and predicts codebook 0 of the next frame
from its last hidden state; the depth decoder then predicts codebooks 1..N-1 one after another, starting from that
hidden state and codebook 0. Both run batched over all streams of a step. :meth:`FrameModel.decode` and
:meth:`FrameModel.generate` read nothing from the host and use fixed-size index tensors, so a whole step can be
captured in a CUDA graph; :meth:`FrameModel.prefill_ids` plans on the host, then runs from graphs bucketed by token
count once :meth:`FrameModel.capture_prefill` has run (eagerly otherwise, as :meth:`FrameModel.prefill` always does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnigate.engines.kv.decoder_stack import DecoderStack
from omnigate.engines.kv.slots import SlotKVCache
from omnigate.engines.talker.model import TalkerModel
from omnigate.engines.talker.prefill_graphs import MIN_BUCKET, PrefillGraphs
from omnigate.engines.talker.sampling import TokenSampler
from omnigate.kernels.sampling import sample_tokens
from omnigate.kernels.sampling_types import SamplingRows

CLOSING = -1  # a token id in a prefill that stands for the frame closing the previous segment's audio


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
        self._backbone_rotary = backbone.rotary_emb
        self.backbone = DecoderStack(backbone.layers, backbone.norm, config)
        self.cache = SlotKVCache(
            layers=self.backbone.layers,
            slots=max_slots,
            capacity=capacity,
            kv_heads=self.backbone.kv_heads,
            head_dim=self.backbone.head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        depth = csm.depth_decoder.model
        self.depth = DecoderStack(depth.layers, depth.norm, depth.config)
        self._depth_embeddings = depth.embed_tokens
        self._depth_projector = depth.inputs_embeds_projector
        self._depth_heads: torch.Tensor = csm.depth_decoder.codebooks_head.weight  # [N-1, hidden, vocab]
        self._depth = _DepthPlan(self.depth, depth.rotary_emb, self.num_codebooks, max_batch, self.device, self.dtype)
        self._no_history = torch.full((1, self.num_codebooks, 0), -1, dtype=torch.int64, device=self.device)
        self.prefill_graphs: PrefillGraphs | None = None
        with torch.no_grad():
            # Every segment after a stream's first opens with this frame closing the previous one's audio.
            self.closing_embedding = self.embed_frames(self.end_of_audio()[None])

    # ---- embeddings ---------------------------------------------------------------------------------------------

    def embed_text(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[T, hidden]`` embeddings of text tokens."""
        ids = torch.tensor(list(token_ids), device=self.device)
        out: torch.Tensor = self._text_embeddings(ids)
        return out

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` embeddings of text token ``ids`` ``[T]``, where a :data:`CLOSING` id stands for the frame
        that closes the previous segment's audio (fixed shapes, no host reads: CUDA-graph safe)."""
        text: torch.Tensor = self._text_embeddings(ids.clamp(min=0))
        return torch.where((ids == CLOSING)[:, None], self.closing_embedding.to(text.dtype), text)

    def embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` embeddings of ``[..., N]`` codec frames (the sum of one embedding per codebook)."""
        flat = frames.reshape(-1, 1, self.num_codebooks)  # the embedding sums over dim 2 of [B, T, N]
        out: torch.Tensor = self._frame_embeddings(flat)
        return out.reshape(*frames.shape[:-1], out.shape[-1])

    def end_of_audio(self) -> torch.Tensor:
        """The frame that closes a segment's audio: every codebook at the end-of-audio id."""
        return torch.full((self.num_codebooks,), self.eos_id, device=self.device, dtype=torch.long)

    # ---- backbone -------------------------------------------------------------------------------------------------

    def _backbone(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self._backbone_rotary(x[None], positions[None])
        out = self.backbone.forward(x, self.cache.keys, self.cache.values, slots, positions, cos[0], sin[0])
        return out

    def _prefill_ids(
        self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        x = self._backbone(self.embed_ids(ids).to(self.dtype), slots, positions)
        return self.backbone.norm(x.index_select(0, last))

    def capture_prefill(self, max_tokens: int, *, capture: bool = True) -> PrefillGraphs:
        """Capture :meth:`prefill_ids` as CUDA graphs for up to ``max_tokens`` tokens (larger prefills replay them
        piece by piece). ``capture=False``: the same bucketing and padding, run eagerly (on any device)."""
        graphs = self.prefill_graphs = PrefillGraphs(
            self._prefill_ids,
            scratch_slot=self.cache.scratch,
            max_tokens=max_tokens,
            device=self.device,
            capture=capture,
        )
        if not capture:
            return graphs
        # Triton compiles a kernel variant per kind of size (1, a multiple of 16, any other); the graphs only saw
        # multiples of 16. Compile the others now, on the scratch slot, so that the first eager prefill (reference
        # audio) does not stall every stream while its kernels compile.
        with torch.no_grad():
            for tokens in (1, MIN_BUCKET + 1):
                index = torch.zeros(tokens, dtype=torch.int64, device=self.device)
                self._prefill_ids(index, index + self.cache.scratch, index, index[:1])
        return graphs

    @torch.no_grad()
    def prefill_ids(self, slots: Sequence[int], unit_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append the tokens ``unit_ids[i]`` (text ids or :data:`CLOSING`) to ``slots[i]``'s context; returns each
        slot's last hidden state after the final norm, ``[len(slots), hidden]``. From the captured graphs once
        :meth:`capture_prefill` ran."""
        counts = [len(ids) for ids in unit_ids]
        flat = [token for ids in unit_ids for token in ids]
        graphs = self.prefill_graphs
        if graphs is None or not flat:
            return self.prefill_flat(slots, counts, self.embed_ids(torch.tensor(flat, device=self.device)))
        rows, positions, last = self.cache.plan_rows(slots, counts)
        hidden = graphs.run(flat, rows, positions, last)
        self.cache.commit(slots, counts)
        return hidden

    def prefill(self, slots: Sequence[int], embeddings: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append ``embeddings[i]`` (``[T_i, hidden]``) to ``slots[i]``'s context in one forward over all their
        tokens; returns each slot's last hidden state after the final norm, ``[len(slots), hidden]``."""
        return self.prefill_flat(slots, [int(e.shape[0]) for e in embeddings], torch.cat(list(embeddings)))

    @torch.no_grad()
    def prefill_flat(self, slots: Sequence[int], counts: Sequence[int], embeddings: torch.Tensor) -> torch.Tensor:
        """:meth:`prefill` with the embeddings already concatenated: ``counts[i]`` rows of ``embeddings`` in order
        belong to ``slots[i]``."""
        rows = self.cache.plan(slots, counts)
        x = self._backbone(embeddings.to(self.dtype), rows.slots, rows.positions)
        self.cache.commit(slots, counts)
        return self.backbone.norm(x.index_select(0, rows.last))

    def extend(self, slot: int, embeddings: torch.Tensor) -> torch.Tensor:
        """Append ``[T, hidden]`` embeddings to ``slot``'s context; returns the last hidden state ``[1, hidden]``."""
        return self.prefill([slot], [embeddings])

    def decode(self, slots: torch.Tensor, positions: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Append frame ``frames[r]`` (``[R, N]``) at ``positions[r]`` of ``slots[r]``; returns the normed hidden
        states ``[R, hidden]``. Device-only: the caller commits the lengths."""
        return self.backbone.norm(self._backbone(self.embed_frames(frames), slots, positions))

    @torch.no_grad()
    def advance(self, slots: Sequence[int], frames: torch.Tensor) -> torch.Tensor:
        """Append each slot's last frame (``[B, N]``); returns ``[B, hidden]`` hidden states."""
        rows = self.cache.plan(slots, [1] * len(slots))
        hidden = self.decode(rows.slots, rows.positions, frames)
        self.cache.commit(slots, [1] * len(slots))
        return hidden

    # ---- one frame from a hidden state ----------------------------------------------------------------------------

    def codebook0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Backbone logits ``[..., vocab]`` for codebook 0."""
        out: torch.Tensor = self._codebook0_head(hidden)
        return out

    def generate(self, hidden: torch.Tensor, rows: SamplingRows, history: torch.Tensor) -> torch.Tensor:
        """Sample the next frame ``[B, N]`` of each row from its backbone hidden state ``[B, hidden]``: codebook 0
        from the backbone head, the others through the depth decoder. ``history`` ``[slots, N, W]`` holds each
        stream's repetition windows per codebook (``W`` may be 0). Device-only, fixed shapes."""
        count = hidden.shape[0]
        if count > self.max_batch:
            raise ValueError(f"{count} rows exceed the depth decoder batch of {self.max_batch}")
        vocab = self.sampler.vocabulary
        codes = [sample_tokens(self.codebook0_logits(hidden), rows, history[:, 0], 0, vocab)]
        plan = self._depth
        # Depth positions 0 and 1 (the backbone state and codebook 0) in one forward: two rows per stream.
        first = self._depth_embeddings(codes[0])
        pairs = torch.stack((hidden, first), dim=1).reshape(2 * count, -1)
        x = self.depth.forward(self._depth_projector(pairs), *plan.pair_rows(count))[1::2]
        for i in range(1, self.num_codebooks):
            if i > 1:
                x = self.depth.forward(self._depth_projector(x), *plan.rows_at(i, count))
            logits = self.depth.norm(x) @ self._depth_heads[i - 1]
            codes.append(sample_tokens(logits, rows, history[:, i], i, vocab))
            if i + 1 < self.num_codebooks:
                x = self._depth_embeddings(codes[i] + i * self.vocab_size)
        return torch.stack(codes, dim=1)

    @torch.no_grad()
    def sample(self, hidden: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """:meth:`generate` without repetition windows: draw ``counters[b] + i`` samples codebook ``i`` of row ``b``."""
        return self.generate(hidden, self.sampler.rows(seeds, counters), self._no_history)


class _DepthPlan:
    """The depth decoder's fixed row layout: row ``r`` of a step owns depth-cache slot ``r``, positions ``0..N-1``
    are the same for every row, so the index tensors and rotary tables are built once and sliced per batch size."""

    def __init__(
        self,
        stack: DecoderStack,
        rotary: Any,
        positions: int,
        max_batch: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (stack.layers, max_batch, positions, stack.kv_heads, stack.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        ids = torch.arange(positions, device=device)
        probe = torch.zeros(1, positions, stack.heads * stack.head_dim, device=device, dtype=dtype)
        cos, sin = rotary(probe, ids[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [N, D]
        rows = torch.arange(max_batch, device=device)
        self.rows = rows
        self.pair_slots = rows.repeat_interleave(2)
        self.pair_positions = torch.tensor([0, 1], device=device).repeat(max_batch)
        self.pair_cos = self.cos[self.pair_positions].contiguous()
        self.pair_sin = self.sin[self.pair_positions].contiguous()
        self.position = ids[:, None].expand(positions, max_batch).contiguous()  # [N, max_batch]
        self.length = self.position + 1

    def pair_rows(self, count: int) -> tuple[torch.Tensor, ...]:
        """Forward arguments after ``x`` for positions 0 and 1 of ``count`` streams (rows interleaved)."""
        n = 2 * count
        return (
            self.keys,
            self.values,
            self.pair_slots[:n],
            self.pair_positions[:n],
            self.pair_cos[:n],
            self.pair_sin[:n],
        )

    def rows_at(self, position: int, count: int) -> tuple[torch.Tensor, ...]:
        """Forward arguments after ``x`` for one token per stream at ``position``."""
        return (
            self.keys,
            self.values,
            self.rows[:count],
            self.position[position, :count],
            self.cos[position].expand(count, -1),
            self.sin[position].expand(count, -1),
            self.length[position, :count],
        )
