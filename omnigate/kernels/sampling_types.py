"""The parameters of batched token sampling, shared by the reference sampler and its Triton kernel.

They live apart from both so that neither imports the other to name them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters and randomness of one batch (every field ``[R]``)."""

    temperature: torch.Tensor  # float32; <= 0 picks the most likely id
    top_k: torch.Tensor  # int32; 0: no cut
    top_p: torch.Tensor  # float32; 1: no cut
    penalty: torch.Tensor  # float32; repetition penalty, 1: none
    seeds: torch.Tensor  # int64 stream seeds
    counters: torch.Tensor  # int64 draw counters
    history_slots: torch.Tensor  # int64 row of the repetition window tensor
    ring: torch.Tensor  # int64 position in the window that the sampled id overwrites

    def head(self, rows: int) -> SamplingRows:
        """The first ``rows`` rows (views)."""
        return SamplingRows(*(getattr(self, f.name)[:rows] for f in fields(self)))


@dataclass(frozen=True)
class Vocabulary:
    """The ids a sampler may return and the end-of-audio bias."""

    valid_ids: int  # ids [0, valid_ids) are eligible
    eos_id: int
    eos_bias: float = 0.0  # added to the end-of-audio logit (positive: shorter audio)
