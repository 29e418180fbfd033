"""The session outbox: events generated but not yet handed to the transport, bounded in media time and bytes.

Engines produce only as much media as the outbox has room for (the session turns free room into engine credit),
so a media chunk that does not fit is a bug upstream, not a condition to wait on. Control events are small and
bounded in count; a reserve keeps room for terminal events so a full outbox can always end an utterance.
"""

from __future__ import annotations

from collections import deque

from omnigate.sessions.messages import Event, MediaChunk, SegmentDone, SegmentStarted


class OutboxOverflow(Exception):
    """An event arrived that the bounds do not admit."""


class Outbox:
    """A FIFO of session events with media-time, byte and count bounds."""

    def __init__(self, *, max_media_ms: float, max_bytes: int, max_events: int = 512, reserve: int = 16) -> None:
        self.max_media_ms = max_media_ms
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.reserve = reserve
        self._items: deque[Event] = deque()
        self.media_ms = 0.0
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def free_media_ms(self) -> float:
        return max(0.0, self.max_media_ms - self.media_ms)

    def holds_audio(self) -> bool:
        """True while a segment's events (its start, audio or end) wait to be sent."""
        return any(isinstance(e, (MediaChunk, SegmentStarted, SegmentDone)) for e in self._items)

    def push(self, event: Event) -> None:
        if isinstance(event, MediaChunk):
            # A little slack: an engine may round the last chunk of a segment up to one frame.
            if self.media_ms + event.duration_ms > self.max_media_ms + 100.0:
                raise OutboxOverflow(f"media over {self.max_media_ms:.0f} ms")
            if self.bytes + len(event.pcm) > self.max_bytes:
                raise OutboxOverflow(f"bytes over {self.max_bytes}")
            if len(self._items) >= self.max_events - self.reserve:
                raise OutboxOverflow(f"more than {self.max_events} events")
            self.media_ms += event.duration_ms
            self.bytes += len(event.pcm)
        elif len(self._items) >= self.max_events:
            raise OutboxOverflow(f"more than {self.max_events} events")
        self._items.append(event)

    def pop(self) -> Event | None:
        if not self._items:
            return None
        event = self._items.popleft()
        if isinstance(event, MediaChunk):
            self.media_ms = max(0.0, self.media_ms - event.duration_ms)
            self.bytes -= len(event.pcm)
        return event

    def purge_media(self, epoch: int) -> float:
        """Drop queued media of ``epoch`` and earlier (cancel); returns the media time dropped."""
        kept: deque[Event] = deque()
        dropped = 0.0
        for event in self._items:
            if isinstance(event, MediaChunk) and event.epoch <= epoch:
                dropped += event.duration_ms
                self.media_ms -= event.duration_ms
                self.bytes -= len(event.pcm)
            else:
                kept.append(event)
        self._items = kept
        self.media_ms = max(0.0, self.media_ms)
        return dropped
