"""How many codec frames each audio chunk of a stream carries.

The first chunk leaves after one frame, so time to first audio is one frame of work; later chunks double up to a
cap, so steady state pays for few codec calls while the client's buffer grows faster than it drains.
"""

from __future__ import annotations


class ChunkSchedule:
    """Chunk ``k`` of a ramp carries ``min(first * 2**k, cap)`` frames."""

    def __init__(self, *, first: int = 1, cap: int = 8) -> None:
        if first < 1 or cap < first:
            raise ValueError("chunk schedule needs 1 <= first <= cap")
        self.first = first
        self.cap = cap

    def frames(self, chunk: int) -> int:
        """Frames in chunk number ``chunk`` (0-based) of a ramp."""
        size = self.first
        for _ in range(chunk):
            if size >= self.cap:
                break
            size *= 2
        return min(size, self.cap)
