"""Token sampling for the duplex model: temperature and top-k, with randomness that belongs to each session.

Each draw hashes (session seed, draw counter, token id) into Gumbel noise (:mod:`omnigate.kernels.sampling`), so a
session samples the same tokens alone or in any batch and no generator state is shared between sessions.
"""

from __future__ import annotations

import torch

from omnigate.kernels.sampling import sample_tokens
from omnigate.kernels.sampling_types import SamplingRows, Vocabulary


class SeededSampler:
    """Draws one id per row from ``[R, V]`` logits restricted to ``[0, valid_ids)``; temperature 0 is greedy."""

    def __init__(self, *, temperature: float, top_k: int, valid_ids: int) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.vocabulary = Vocabulary(valid_ids=valid_ids, eos_id=0, eos_bias=0.0)

    def __call__(self, logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        count, device = seeds.shape[0], seeds.device
        zeros = torch.zeros(count, dtype=torch.int64, device=device)
        rows = SamplingRows(
            temperature=torch.full((count,), self.temperature, dtype=torch.float32, device=device),
            top_k=torch.full((count,), self.top_k, dtype=torch.int32, device=device),
            top_p=torch.ones(count, dtype=torch.float32, device=device),
            penalty=torch.ones(count, dtype=torch.float32, device=device),
            seeds=seeds,
            counters=counters,
            history_slots=zeros,
            ring=zeros,
        )
        no_history = torch.empty((1, 0), dtype=torch.int64, device=device)  # no repetition penalty
        return sample_tokens(logits.contiguous(), rows, no_history, 0, self.vocabulary)
