"""A key/value cache organised in slots: one preallocated row per stream, each with its own length.

Streams join and leave between steps by taking and returning a slot; a forward over any set of slots appends the
same number of new tokens to each, writes them at each slot's own length and attends over that slot's history only.
Lengths are kept on the host, so planning a step never waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ContextFull(Exception):
    """A slot has no room for the tokens a forward would append."""


@dataclass(frozen=True)
class SlotBatch:
    """Where the new tokens of one forward go: rows, their cache positions, and what each token may attend to."""

    slots: tuple[int, ...]
    index: torch.Tensor  # [B] slot of each row
    positions: torch.Tensor  # [B, T] cache position (and rotary position) of each new token
    allowed: torch.Tensor  # [B, T, span] key visibility, causal within each slot
    span: int  # keys read per row: the longest history in the batch plus the new tokens

    @property
    def steps(self) -> int:
        return int(self.positions.shape[1])


class SlotKVCache:
    """Keys and values of ``layers`` attention layers for ``slots`` streams of up to ``capacity`` tokens."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (layers, slots, capacity, kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.device = device
        self._lengths = [0] * slots

    def length(self, slot: int) -> int:
        """Tokens held by ``slot``."""
        return self._lengths[slot]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` for a new stream; stale entries beyond the length are never read."""
        self._lengths[slot] = 0

    def batch(self, slots: Sequence[int], steps: int) -> SlotBatch:
        """Plan a forward appending ``steps`` tokens to each of ``slots``. Raises :class:`ContextFull`."""
        lengths = [self._lengths[s] for s in slots]
        if max(lengths) + steps > self.capacity:
            raise ContextFull(f"a slot cannot take {steps} more tokens (capacity {self.capacity})")
        start = torch.tensor(lengths, device=self.device)
        offsets = torch.arange(steps, device=self.device)
        positions = start[:, None] + offsets[None, :]
        span = max(lengths) + steps
        keys = torch.arange(span, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]
        return SlotBatch(
            slots=tuple(slots),
            index=torch.tensor(list(slots), device=self.device),
            positions=positions,
            allowed=allowed,
            span=span,
        )

    def append(
        self, layer: int, batch: SlotBatch, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``[B, T, Hkv, D]`` keys and values, and return each row's ``[B, span, Hkv, D]`` history."""
        rows = batch.index[:, None].expand_as(batch.positions)
        self.keys[layer].index_put_((rows, batch.positions), keys)
        self.values[layer].index_put_((rows, batch.positions), values)
        history_keys = self.keys[layer, :, : batch.span].index_select(0, batch.index)
        history_values = self.values[layer, :, : batch.span].index_select(0, batch.index)
        return history_keys, history_values

    def commit(self, batch: SlotBatch) -> None:
        """Count the batch's tokens as held, once every layer has appended them."""
        for slot in batch.slots:
            self._lengths[slot] += batch.steps
