"""Batched next-token sampling for the thinker: one row per answer, on the logits' device.

A row with temperature 0 takes the most likely id. Any other row samples from ``softmax(logits / temperature)`` by
inverse CDF: its uniform draw ``u`` in [0, 1), scaled by the row's total probability, selects the first id whose
cumulative probability exceeds it. That is exact multinomial sampling, and since each answer draws its uniforms
from its own seeded generator, an answer's tokens do not depend on which other answers share its step. Only the
``[B]`` ids leave the device.
"""

from __future__ import annotations

import torch


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Ids ``[B]`` (int64) sampled from ``logits`` ``[B, V]``: ``temperature`` and ``uniforms`` are ``[B]`` on the
    logits' device (a row's uniform is unused when its temperature is 0)."""
    hot = temperature > 0
    scaled = logits.float() / torch.where(hot, temperature, 1.0).float()[:, None]
    # float64 sums: the cumulative probability over a 150k-id vocabulary keeps its resolution near 1
    cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[1] - 1)
    return torch.where(hot, sampled, logits.argmax(dim=-1))
