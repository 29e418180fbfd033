"""A key/value cache of fixed-size windows, one per slot, written as rings.

A duplex session never ends its context: it advances one step per tick for as long as the call lasts. Each slot
keeps the keys and values of its last ``window`` steps; step ``p`` is written at ring index ``p % window``, over the
step that left the window. Attention does not depend on the order of keys (positions are already rotated into them),
so reading the whole ring with a mask of the entries written so far is exact. Every step reads the full window, so a
tick costs the same whatever the age of the sessions in it: capacity measured once holds for the whole call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingStep:
    """One step of a set of slots: their rows, write positions, and which ring entries each may read."""

    slots: tuple[int, ...]
    index: torch.Tensor  # [B] slot of each row
    positions: torch.Tensor  # [B] absolute (rotary) position of the new step
    ring: torch.Tensor  # [B] ring index the new step is written at
    allowed: torch.Tensor  # [B, 1, window] entries holding history, including the new step
    rows: slice | None  # the slots as one contiguous range, read as a view instead of a gathered copy


class RingKVCache:
    """Keys and values of ``layers`` attention layers for ``slots`` sessions with a window of ``window`` steps."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        window: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if window < 1:
            raise ValueError("the window must hold at least one step")
        shape = (layers, slots, window, kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.window = window
        self.device = device
        self._positions = [0] * slots

    def position(self, slot: int) -> int:
        """Steps taken by the session in ``slot``."""
        return self._positions[slot]

    def reset(self, slot: int) -> None:
        """Start a new session in ``slot``; the old entries are masked out until overwritten."""
        self._positions[slot] = 0

    def step(self, slots: Sequence[int]) -> RingStep:
        """Plan one step for each of ``slots``."""
        positions = torch.tensor([self._positions[s] for s in slots], device=self.device)
        return self.step_at(slots, torch.tensor(list(slots), device=self.device), positions)

    def step_at(self, slots: Sequence[int], index: torch.Tensor, positions: torch.Tensor) -> RingStep:
        """:meth:`step` from device tensors the caller already holds: ``index`` (the slots) and ``positions``
        (:meth:`position` of each), so planning a step copies nothing from the host."""
        filled = (positions + 1).clamp(max=self.window)
        allowed = torch.arange(self.window, device=self.device)[None, :] < filled[:, None]
        return RingStep(
            slots=tuple(slots),
            index=index,
            positions=positions,
            ring=positions % self.window,
            allowed=allowed[:, None, :],
            rows=_as_range(slots),
        )

    def write(
        self, layer: int, step: RingStep, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``[B, Hkv, D]`` keys and values; returns each row's ``[B, window, Hkv, D]`` ring."""
        self.keys[layer].index_put_((step.index, step.ring), keys)
        self.values[layer].index_put_((step.index, step.ring), values)
        if step.rows is not None:
            return self.keys[layer, step.rows], self.values[layer, step.rows]
        return self.keys[layer].index_select(0, step.index), self.values[layer].index_select(0, step.index)

    def commit(self, step: RingStep, slots: Sequence[int] | None = None) -> None:
        """Count the step as taken for ``slots`` (default: all of its rows), once every layer has written it.

        A row left out (masked) stays where it was: the entry it wrote is the one its next real step writes
        again, and the entry that held before it is the one that step evicts, so its history is unchanged.
        """
        for slot in step.slots if slots is None else slots:
            self._positions[slot] += 1


def _as_range(slots: Sequence[int]) -> slice | None:
    first = slots[0] if slots else 0
    if list(slots) == list(range(first, first + len(slots))):
        return slice(first, first + len(slots))
    return None
