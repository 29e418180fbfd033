"""Batched token sampling whose randomness belongs to each stream, not to the batch.

One call samples one token per row from logits with an end-of-audio bias, a repetition penalty over the row's recent
tokens, temperature, top-k and top-p, then Gumbel-max with noise computed by hashing (stream seed, draw counter,
token id): a stream draws the same tokens whether it runs alone or in any batch, in any row, and no generator state
is shared or synced. Parameters are per-row tensors, so the call has fixed shapes and can sit inside a CUDA graph.
"""

from __future__ import annotations

import torch

from omnigate.kernels.backend import triton_kernels, use_triton
from omnigate.kernels.sampling_types import SamplingRows, Vocabulary

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


def sample_tokens_reference(
    logits: torch.Tensor, rows: SamplingRows, history: torch.Tensor, draw: int, vocab: Vocabulary
) -> torch.Tensor:
    """Sample ``[R]`` int64 ids from ``logits`` ``[R, V]`` restricted to ``[0, vocab.valid_ids)``.

    Per row ``r``: ``eos_bias`` is added to the end-of-audio logit; ids in the row's repetition window
    ``history[history_slots[r]]`` (``history`` is ``[slots, W]``, -1 marks empty places) get the penalty (positive
    logits divided by it, negative ones multiplied); a temperature <= 0 picks the most likely id; otherwise logits
    are divided by the temperature, cut to the ``top_k`` best and then to the smallest set holding ``top_p`` of the
    probability, and sampled by Gumbel-max with draw counter ``counters[r] + draw``. The sampled id is written into
    the window at ``ring[r]``.
    """
    valid = vocab.valid_ids
    scores = logits[:, :valid].float().clone()
    if 0 <= vocab.eos_id < valid:
        scores[:, vocab.eos_id] += vocab.eos_bias
    window = history.shape[-1]
    if window:
        recent = history[rows.history_slots]
        present = (recent >= 0) & (recent < valid)
        hits = torch.zeros(scores.shape, dtype=torch.int64, device=logits.device)
        hits.scatter_add_(1, recent.clamp(0, valid - 1), present.long())
        factor = rows.penalty[:, None].float()
        penalized = torch.where(scores > 0, scores / factor, scores * factor)
        scores = torch.where(hits > 0, penalized, scores)
    greedy = scores.argmax(dim=-1)
    temperature = rows.temperature
    scaled = scores / torch.where(temperature > 0, temperature, 1.0)[:, None]
    k = rows.top_k.long()
    k = torch.where((k > 0) & (k < valid), k, valid)
    kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    keep = scaled >= kth
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    top_p = rows.top_p[:, None]
    within = (before < top_p) | (top_p >= 1.0)
    keep &= torch.zeros_like(keep).scatter(1, order, within)
    gumbel = -torch.log(-torch.log(uniform_noise(rows.seeds, rows.counters + draw, valid)))
    sampled = (scaled + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1)
    tokens = torch.where(temperature > 0, sampled, greedy)
    if window:
        history[rows.history_slots, rows.ring] = tokens
    return tokens


def sample_tokens(
    logits: torch.Tensor, rows: SamplingRows, history: torch.Tensor, draw: int, vocab: Vocabulary
) -> torch.Tensor:
    """:func:`sample_tokens_reference` as one Triton kernel on CUDA: one program per row finds the exact top-k and
    top-p thresholds by bisection over the float order (no sort) and draws the same noise."""
    if use_triton(logits) and logits.stride(-1) == 1 and (history.shape[-1] == 0 or history.stride(-1) == 1):
        out: torch.Tensor = triton_kernels().sample_tokens(logits, rows, history, draw, vocab)
        return out
    return sample_tokens_reference(logits, rows, history, draw, vocab)
