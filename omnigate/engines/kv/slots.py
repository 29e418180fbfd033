"""A key/value cache organised in slots: one preallocated row per stream, each with its own length.

Streams join and leave between steps by taking and returning a slot. A forward appends tokens to any set of slots,
each writing at its own length and attending over its own history only. Lengths are kept on the host, so planning a
step never waits on the device. One extra slot, :attr:`SlotKVCache.scratch`, belongs to no stream: rows of a
fixed-size batch that carry no stream write there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ContextFull(Exception):
    """A slot has no room for the tokens a forward would append."""


@dataclass(frozen=True)
class TokenRows:
    """The new tokens of one forward, flattened: which slot and cache position each token goes to."""

    slots: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64: cache position, also the rotary position
    last: torch.Tensor  # [len(planned)] int64: index of each planned slot's last token among the rows
    counts: tuple[int, ...]  # tokens per planned slot, in order
    planned: tuple[int, ...]  # the slots, once each


class SlotKVCache:
    """Keys and values of ``layers`` attention layers for ``slots`` streams (plus a scratch slot) of up to
    ``capacity`` tokens, laid out ``[layers, slot, position, kv_heads, head_dim]``."""

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
        shape = (layers, slots + 1, capacity, kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.device = device
        self.scratch = slots
        self._lengths = [0] * (slots + 1)

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one slot's keys and values."""
        per = self.keys[:, 0].numel() * self.keys.element_size()
        return 2 * per

    def length(self, slot: int) -> int:
        """Tokens held by ``slot``."""
        return self._lengths[slot]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` for a new stream; stale entries beyond the length are never read."""
        self._lengths[slot] = 0

    def keep_prefix(self, slot: int, source: int, tokens: int) -> None:
        """Make ``slot`` hold the first ``tokens`` entries of ``source`` (``slot`` itself: truncate it), so a stream
        sharing those tokens appends after them. Entries beyond the new length are stale and never read: a row
        attends only up to its own position, and every position before it is written by then."""
        if not 0 <= tokens <= self._lengths[source]:
            raise ValueError(f"slot {source} holds {self._lengths[source]} tokens, not {tokens}")
        if source != slot:
            self.keys[:, slot, :tokens] = self.keys[:, source, :tokens]
            self.values[:, slot, :tokens] = self.values[:, source, :tokens]
        self._lengths[slot] = tokens

    def plan(self, slots: Sequence[int], counts: Sequence[int]) -> TokenRows:
        """Rows appending ``counts[i]`` tokens to ``slots[i]``. Raises :class:`ContextFull`."""
        slot_ids, positions, last = self.plan_rows(slots, counts)
        rows = len(slot_ids)
        # One host-to-device copy for the three index vectors: each copy waits for the device's queue.
        packed = torch.tensor(slot_ids + positions + last, device=self.device, dtype=torch.int64)
        return TokenRows(
            slots=packed[:rows],
            positions=packed[rows : 2 * rows],
            last=packed[2 * rows :],
            counts=tuple(counts),
            planned=tuple(slots),
        )

    def plan_rows(self, slots: Sequence[int], counts: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """:meth:`plan` on the host: each row's slot and position, and each planned slot's last row."""
        slot_ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for slot, count in zip(slots, counts, strict=True):
            start = self._lengths[slot]
            if start + count > self.capacity:
                raise ContextFull(f"slot {slot} cannot take {count} more tokens (capacity {self.capacity})")
            slot_ids.extend([slot] * count)
            positions.extend(range(start, start + count))
            last.append(len(slot_ids) - 1)
        return slot_ids, positions, last

    def commit(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Count appended tokens as held, once every layer has written them."""
        for slot, count in zip(slots, counts, strict=True):
            self._lengths[slot] += count
