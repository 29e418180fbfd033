"""Batched temperature/top-k sampling whose randomness belongs to each stream, not to the batch.

Every draw uses Gumbel-max with noise computed by hashing (stream seed, draw counter, token id), so a stream samples
the same tokens whether it runs alone or in any batch, in any row, and no generator state is shared or synced.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``x * factor mod 2**32`` on int64 without overflowing: multiply 16-bit halves separately."""
    low = (x & 0xFFFF) * factor
    high = (((x >> 16) * factor) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform values in ``(0, 1)``, ``[B, vocab]``, a pure function of each row's seed and counter."""
    seed32 = (seeds ^ (seeds >> 32)) & _MASK32
    row = _mix32((_mix32(seed32) + counters) & _MASK32)
    token = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64) + 0x9E3779B9)
    bits = _mix32(row[:, None] ^ token[None, :]) >> 8  # 24 bits: exact in float32
    return (bits.to(torch.float32) + 0.5) / float(1 << 24)


class TokenSampler:
    """Samples one token per row from logits restricted to the ids ``[0, valid_ids)``."""

    def __init__(self, *, temperature: float, top_k: int, valid_ids: int, eos_id: int, eos_bias: float) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.valid_ids = valid_ids
        self.eos_id = eos_id
        self.eos_bias = eos_bias

    def __call__(self, logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, V]``; returns ``[B]`` int64 ids. Temperature 0 picks the most likely id.

        ``eos_bias`` is added to the end-of-audio id's logit before anything else (positive: shorter audio).
        """
        scores = logits[:, : self.valid_ids].float()
        if self.eos_bias:
            scores = scores.clone()
            scores[:, self.eos_id] += self.eos_bias
        if self.temperature <= 0.0:
            return scores.argmax(dim=-1)
        scores = scores / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, scores.shape[-1])))
        return (scores + gumbel).argmax(dim=-1)
