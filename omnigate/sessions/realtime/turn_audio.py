"""The user's audio of the turn in progress, kept for transcription (sans-I/O), bounded in bytes.

Positions are milliseconds on the turn detector's timeline (the audio it heard since it started), so a turn's
audio is cut where the detector says speech started (prefix padding included) and stopped. Outside a turn only the
padding a next turn would start with is kept. Without a detector (client commits) everything since the last commit
is the turn. Beyond ``max_bytes`` the oldest audio goes: a turn that long keeps its newest part.
"""

from __future__ import annotations

BYTES_PER_MS = 48  # 24 kHz mono s16le


class TurnAudio:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pcm = bytearray()
        self._start_ms = 0.0  # the position of the first byte held

    def __len__(self) -> int:
        return len(self._pcm)

    def add(self, pcm: bytes) -> None:
        self._pcm.extend(pcm)
        excess = len(self._pcm) - self.max_bytes
        if excess > 0:
            self._drop(excess + excess % 2)

    def keep_from(self, position_ms: float) -> None:
        """Forget the audio before ``position_ms`` (the start of a turn, or of the padding before one)."""
        self._drop(self._offset(position_ms))

    def take_until(self, position_ms: float) -> bytes:
        """The audio up to ``position_ms`` (the end of a turn), which is forgotten."""
        cut = self._offset(position_ms)
        turn = bytes(self._pcm[:cut])
        self._drop(cut)
        return turn

    def take_all(self) -> bytes:
        turn = bytes(self._pcm)
        self._drop(len(self._pcm))
        return turn

    def restart(self) -> None:
        """A new detector timeline begins at 0 with nothing held."""
        self._pcm.clear()
        self._start_ms = 0.0

    def _offset(self, position_ms: float) -> int:
        offset = int((position_ms - self._start_ms) * BYTES_PER_MS)
        return max(0, min(len(self._pcm), offset - offset % 2))

    def _drop(self, count: int) -> None:
        if count > 0:
            del self._pcm[:count]
            self._start_ms += count / BYTES_PER_MS
