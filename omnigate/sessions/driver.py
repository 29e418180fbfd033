"""Binds a :class:`SpeechSession` to an engine pool, an outbox and the event loop's clock.

The driver has no transport: a wire adapter calls :meth:`submit` for each client command and awaits
:meth:`next_event` in its writer. Engine outputs arrive on the loop through the pool's ``call_soon_threadsafe``;
timers are ``loop.call_at`` handles. Everything runs on one loop, so the session has a single writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from omnigate.engines.base import EngineError, EngineOutput
from omnigate.engines.pool import PoolClosed, PoolFull
from omnigate.engines.pool_api import EnginePoolAPI, SessionPinning
from omnigate.sessions.messages import Command, ErrorEvent, Event, MediaChunk, SessionClosed
from omnigate.sessions.outbox import Outbox
from omnigate.sessions.speech import (
    AbortStream,
    Action,
    Emit,
    EndInput,
    OpenStream,
    PurgeMedia,
    PushText,
    SessionLimits,
    SpeechSession,
)

log = logging.getLogger(__name__)


def monotonic_ms() -> float:
    return time.monotonic() * 1000.0


class SessionDriver:
    """Runs one speech session on the current event loop."""

    def __init__(
        self, pool: EnginePoolAPI[Any], limits: SessionLimits, on_first_audio: Callable[[float], None] | None = None
    ) -> None:
        """``on_first_audio`` receives, per utterance, the ms from its engine stream's opening to its first audio
        leaving the outbox. A pool with several engine replicas is used through a view pinned to one of them."""
        self._unpin: Callable[[], None] | None = None
        if isinstance(pool, SessionPinning):
            pinned = pool.pin_session()
            self._unpin = pinned.unpin
            pool = pinned
        self.pool = pool
        self._on_first_audio = on_first_audio
        self._opened_ms: dict[int, float] = {}
        self.limits = limits
        self.session = SpeechSession(pool.info, limits, monotonic_ms())
        self.outbox = Outbox(max_media_ms=limits.outbox_media_ms, max_bytes=limits.outbox_bytes)
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, Any] = {}
        self._ready = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._finished = False
        self.generated_ms = 0.0
        self.delivered_ms = 0.0
        self._reschedule()

    # ---- inputs -----------------------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        self._apply(self.session.handle(command, monotonic_ms()))

    def abort(self, reason: str, code: str | None = None) -> None:
        """The client is gone or the server stops: abort engine work and end the session."""
        self._apply(self.session.abort_all(reason, code))

    def report(self, error: ErrorEvent) -> None:
        """Queue a non-fatal protocol error (a bad client message) in order with the session's other events.

        A client that floods bad messages without reading the answers fills the outbox; it is closed, typed,
        using the outbox's reserve for terminal events.
        """
        if len(self.outbox) >= self.outbox.max_events - self.outbox.reserve:
            self.fail("backlog", "too many unread events; the client is not reading")
            return
        self._apply([Emit(error)])

    def fail(self, code: str, message: str) -> None:
        """End the session with a fatal typed error; the writer sends it and closes."""
        self._apply(self.session.fail(code, message))

    async def next_event(self) -> Event:
        """The next event for the transport; :class:`SessionClosed` is the last one."""
        while True:
            event = self.outbox.pop()
            if event is not None:
                if isinstance(event, MediaChunk):
                    self.delivered_ms += event.duration_ms
                    opened = self._opened_ms.pop(event.utterance, None)
                    if opened is not None and self._on_first_audio is not None:
                        self._on_first_audio(monotonic_ms() - opened)
                    head = self.session.active_utterance
                    if head is not None and head in self._streams:
                        self.pool.grant(self._streams[head], event.duration_ms)
                return event
            self._ready.clear()
            await self._ready.wait()

    @property
    def closed(self) -> bool:
        return self.session.closed

    def release(self) -> None:
        """Free every engine stream and timer. Idempotent; the owner calls it when the session's scope ends."""
        if self._finished:
            return
        self._finished = True
        if not self.session.closed:
            self.session.abort_all("released")
        for ps in self._streams.values():
            self.pool.abort(ps)
        self._streams.clear()
        if self._unpin is not None:
            self._unpin()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- internals --------------------------------------------------------------------------------------------

    def _on_engine(self, utterance: int, outputs: list[EngineOutput]) -> None:
        if self._finished:
            return
        self._apply(self.session.on_engine(utterance, outputs, monotonic_ms()))

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Emit):
                if isinstance(action.event, MediaChunk):
                    self.generated_ms += action.event.duration_ms
                self.outbox.push(action.event)
                self._ready.set()
            elif isinstance(action, OpenStream):
                self._open(action)
            elif isinstance(action, PushText):
                ps = self._streams.get(action.utterance)
                if ps is not None:
                    self.pool.push_text(ps, action.text)
            elif isinstance(action, EndInput):
                ps = self._streams.get(action.utterance)
                if ps is not None:
                    self.pool.end_input(ps)
            elif isinstance(action, AbortStream):
                ps = self._streams.pop(action.utterance, None)
                if ps is not None:
                    self.pool.abort(ps)
            elif isinstance(action, PurgeMedia):
                self.outbox.purge_media(action.epoch)
        self._forget_finished_streams()
        if self.session.closed:
            for ps in self._streams.values():
                self.pool.abort(ps)
            self._streams.clear()
        self._reschedule()

    def _open(self, action: OpenStream) -> None:
        utterance = action.utterance

        def sink(outputs: list[EngineOutput]) -> None:
            self._on_engine(utterance, outputs)

        try:
            ps = self.pool.open(action.params, sink, initial_credit_ms=self.outbox.free_media_ms)
        except PoolFull:
            self._apply(self.session.on_stream_refused(utterance, "engine_busy", "no free engine slot; retry shortly"))
            return
        except PoolClosed:
            self._apply(self.session.on_stream_refused(utterance, "shutting_down", "the server is shutting down"))
            return
        except EngineError as exc:
            self._apply(self.session.on_stream_refused(utterance, exc.code, exc.message))
            return
        self._streams[utterance] = ps
        self._opened_ms[utterance] = monotonic_ms()
        if len(self._opened_ms) > 64:  # utterances that never produced audio
            self._opened_ms.pop(next(iter(self._opened_ms)))

    def _forget_finished_streams(self) -> None:
        done = [u for u, ps in self._streams.items() if ps.closed]
        for u in done:
            del self._streams[u]

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._finished:
            return
        deadline = self.session.next_deadline_ms()
        if deadline is None:
            return
        # A deadline already past after a poll means nothing was releasable: wait a little, never spin.
        delay = max(0.005, (deadline - monotonic_ms()) / 1000.0)
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self._finished:
            self._apply(self.session.poll(monotonic_ms()))


__all__ = ["SessionClosed", "SessionDriver", "monotonic_ms"]
