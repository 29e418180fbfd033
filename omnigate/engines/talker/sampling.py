"""The engine-wide sampling settings of the talker, turned into the per-row tensors the sampling kernel takes.

The sampling itself (end-of-audio bias, repetition penalty, temperature, top-k, top-p and seeded Gumbel-max noise
that belongs to each stream) is :func:`omnigate.kernels.sampling.sample_tokens`.
"""

from __future__ import annotations

import torch

from omnigate.kernels.sampling_types import SamplingRows, Vocabulary


class TokenSampler:
    """How every codebook token is drawn: the same settings for every stream."""

    def __init__(
        self,
        *,
        temperature: float,
        top_k: int,
        valid_ids: int,
        eos_id: int,
        eos_bias: float,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        repetition_window: int = 0,
    ) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.repetition_penalty = repetition_penalty
        self.repetition_window = repetition_window if repetition_penalty != 1.0 else 0
        self.vocabulary = Vocabulary(valid_ids=valid_ids, eos_id=eos_id, eos_bias=eos_bias)

    def rows(
        self,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        history_slots: torch.Tensor | None = None,
        ring: torch.Tensor | None = None,
    ) -> SamplingRows:
        """Per-row tensors for rows with these seeds and draw counters (``[R]`` int64, on the sampling device)."""
        count, device = seeds.shape[0], seeds.device
        zeros = torch.zeros(count, dtype=torch.int64, device=device)
        return SamplingRows(
            temperature=torch.full((count,), self.temperature, dtype=torch.float32, device=device),
            top_k=torch.full((count,), self.top_k, dtype=torch.int32, device=device),
            top_p=torch.full((count,), self.top_p, dtype=torch.float32, device=device),
            penalty=torch.full((count,), self.repetition_penalty, dtype=torch.float32, device=device),
            seeds=seeds,
            counters=counters,
            history_slots=zeros if history_slots is None else history_slots,
            ring=zeros if ring is None else ring,
        )
