"""What a realtime session has produced and the transport has not taken yet, bounded in media time and count.

Audio is admitted only while there is media room (the producers wait for room, or hold engine credit, before they
produce), so the media bound holds to within one chunk. Control events are small; a reserve keeps room for the
events that end a response or the session even when a client has stopped reading.

The queue is plain data: ``on_change`` (called after anything is queued, taken or dropped) is how a transport
adapter learns that there is something to send or room again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec


class OutgoingEvent(msgspec.Struct, frozen=True):
    """One encoded server event; ``audio_ms`` is the audio it carries (an ``output_audio.delta``)."""

    payload: bytes
    response_id: str | None = None
    item_id: str | None = None
    audio_ms: float = 0.0


class OutgoingAudio(msgspec.Struct, frozen=True):
    """Output audio for a media track (mono s16le PCM), when audio does not travel as events."""

    pcm: bytes
    sample_rate: int
    response_id: str
    item_id: str
    audio_ms: float


class Closing(msgspec.Struct, frozen=True):
    """The last output of a session: close the transport with ``close_code`` (WebSocket codes)."""

    reason: str
    code: str | None
    close_code: int


RealtimeOutput = OutgoingEvent | OutgoingAudio | Closing


class OutboxOverflow(Exception):
    """More events than the bound admits: the client is not reading."""


def _nothing() -> None:
    pass


class RealtimeOutbox:
    def __init__(
        self, *, max_media_ms: float, max_events: int, reserve: int = 16, on_change: Callable[[], None] = _nothing
    ) -> None:
        self.max_media_ms = max_media_ms
        self.max_events = max_events
        self.reserve = reserve
        self.media_ms = 0.0
        self.on_change = on_change
        self._items: deque[RealtimeOutput] = deque()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def has_media_room(self) -> bool:
        return self.media_ms < self.max_media_ms

    @property
    def has_event_room(self) -> bool:
        """Fewer events queued than half of what a producer may queue: a producer of many small events (an LLM
        reply's deltas) waits for this before it reads more, so a burst is paced by the client's reading rather
        than overflowing the bound."""
        return len(self._items) < (self.max_events - self.reserve) // 2

    def push(self, output: RealtimeOutput, *, terminal: bool = False) -> None:
        """Queue ``output``; ``terminal`` outputs (ends of responses and of the session) may use the reserve."""
        limit = self.max_events if terminal else self.max_events - self.reserve
        if len(self._items) >= limit:
            raise OutboxOverflow(f"more than {limit} unsent events")
        self._items.append(output)
        if not isinstance(output, Closing) and output.audio_ms:
            self.media_ms += output.audio_ms
        self.on_change()

    def pop(self) -> RealtimeOutput | None:
        if not self._items:
            return None
        output = self._items.popleft()
        if not isinstance(output, Closing) and output.audio_ms:
            self._take_media(output.audio_ms)
        self.on_change()
        return output

    def purge_audio(self, response_id: str | None = None) -> float:
        """Drop queued audio of ``response_id`` (None: of every response); returns the media time dropped."""
        kept: deque[RealtimeOutput] = deque()
        dropped = 0.0
        for output in self._items:
            if (
                not isinstance(output, Closing)
                and output.audio_ms > 0
                and (response_id is None or output.response_id == response_id)
            ):
                dropped += output.audio_ms
            else:
                kept.append(output)
        self._items = kept
        self._take_media(dropped)
        self.on_change()
        return dropped

    def replace_all(self, output: RealtimeOutput) -> None:
        """Drop everything queued and queue ``output`` alone (closing a client that stopped reading)."""
        self._items.clear()
        self._take_media(self.media_ms)
        self._items.append(output)
        self.on_change()

    def _take_media(self, ms: float) -> None:
        self.media_ms = max(0.0, self.media_ms - ms)
