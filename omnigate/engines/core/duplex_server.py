"""The core side of duplex sessions: one gateway connection's sessions on the core's :class:`DuplexEngine`.

The engine's clock thread hands each tick's frames to the core's event loop in one callback, which calls the
sessions' sinks one after the other; each sink only files its frame, and one flush scheduled behind them writes the
tick as ONE message per connection (up to :data:`TICK_FRAMES_PER_MESSAGE` sessions). Writes never wait: what a
connection buffers is bounded by the credit its sessions were granted (a session without credit sits the tick out)
plus one stats message, skipped while the gateway is not reading. A connection that drops closes its sessions at
once, freeing their slots. Every open is answered (DUPLEX_OPENED, or DUPLEX_ENDED with the refusal): the core's
slots are shared by every gateway connection, so only the core can admit exactly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnigate.engines.core.duplex_protocol import (
    ENCODER,
    DuplexEnded,
    DuplexGrant,
    DuplexInfo,
    DuplexOpen,
    DuplexTick,
    SessionFrame,
)
from omnigate.engines.core.framing import Frame, FrameError, FrameKind, decode_body, encode_frame
from omnigate.engines.core.stats_push import push_stats
from omnigate.engines.duplex.session import DuplexClosed, DuplexFrame, DuplexFull, DuplexSession

if TYPE_CHECKING:
    from omnigate.engines.duplex.engine import DuplexEngine

log = logging.getLogger(__name__)


# A tick's frames cross as one message up to this many sessions (an 80 ms frame is ~4 KB: ~2 MB, well within a
# frame's bound); a larger engine's tick goes as several.
TICK_FRAMES_PER_MESSAGE = 512

Send = Callable[[bytes], None]
"""Writes bytes on the connection without waiting."""


@dataclass(eq=False)
class _Served:
    session: DuplexSession
    input_done: int = 0  # input bytes consumed by delivered ticks or dropped by clears


class DuplexLink:
    """The duplex sessions of one gateway connection. Runs on the core's event loop."""

    def __init__(self, engine: DuplexEngine, send: Send, backlog: Callable[[], int]) -> None:
        self._engine = engine
        self._send = send
        self._backlog = backlog
        self._frame_bytes = 2 * engine.samples_per_frame
        self._served: dict[int, _Served] = {}  # by the gateway's session id; bounded by the engine's slots
        self._tick: list[SessionFrame] = []
        self._flush_scheduled = False
        self._stats: asyncio.Task[None] | None = None

    def handle(self, frame: Frame) -> None:
        """One DUPLEX_* frame from the gateway. Raises :class:`FrameError` for one that breaks the protocol."""
        kind, call = frame.kind, frame.call
        if kind is FrameKind.DUPLEX_HELLO:
            self._hello()
            return
        if kind is FrameKind.DUPLEX_OPEN:
            if call in self._served:
                raise FrameError(f"duplex session {call} is already open")
            self._open(call, decode_body(frame.body, DuplexOpen))
            return
        served = self._served.get(call)
        if served is None:
            return  # ended by the core already (refused, or its step failed): the gateway hears DUPLEX_ENDED
        if kind is FrameKind.DUPLEX_AUDIO:
            if not self._engine.push_audio(served.session, frame.body):
                log.warning("duplex session %d sent input past its cap; dropped", call)
        elif kind is FrameKind.DUPLEX_CLEAR:
            served.input_done += self._engine.clear_input(served.session)
        elif kind is FrameKind.DUPLEX_GRANT:
            self._engine.grant(served.session, decode_body(frame.body, DuplexGrant).frames)
        elif kind is FrameKind.DUPLEX_CLOSE:
            del self._served[call]
            self._engine.close_session(served.session)
        else:
            raise FrameError(f"a gateway may not send {kind.name}")

    def close(self) -> None:
        """The connection is gone: close every session it held now."""
        if self._stats is not None:
            self._stats.cancel()
        served, self._served = list(self._served.values()), {}
        for item in served:
            self._engine.close_session(item.session)

    # ---- internals --------------------------------------------------------------------------------------------

    def _hello(self) -> None:
        engine = self._engine
        info = DuplexInfo(
            info=engine.info,
            sample_rate=engine.sample_rate,
            frame_s=engine.frame_s,
            retry_after_s=engine.options.retry_after_s,
            stats=engine.stats,
        )
        self._send(encode_frame(FrameKind.DUPLEX_INFO, 0, ENCODER.encode(info)))
        if self._stats is None:
            pushing = push_stats(self._engine.stats, FrameKind.DUPLEX_STATS, self._send, self._backlog)
            self._stats = asyncio.get_running_loop().create_task(pushing, name="duplex-core-stats")

    def _open(self, call: int, request: DuplexOpen) -> None:
        served: _Served | None = None

        def sink(frame: DuplexFrame) -> None:
            if served is None:
                return
            if frame.input_ms > 0.0:
                served.input_done += self._frame_bytes
            self._tick.append(SessionFrame(call, frame, served.input_done))
            if not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)

        def on_end(code: str, message: str) -> None:
            if self._served.pop(call, None) is not None:
                self._ended(call, DuplexEnded(code, message))

        try:
            session = self._engine.open_session(
                sink,
                max_input_bytes=request.max_input_bytes,
                initial_credit_frames=request.initial_credit_frames,
                seed=request.seed,
                on_end=on_end,
            )
        except DuplexFull as exc:
            self._ended(call, DuplexEnded("resource_exhausted", str(exc), exc.retry_after_s))
            return
        except DuplexClosed:
            self._ended(call, DuplexEnded("shutting_down", "the engine core is shutting down"))
            return
        served = self._served[call] = _Served(session)
        self._send(encode_frame(FrameKind.DUPLEX_OPENED, call))

    def _ended(self, call: int, ended: DuplexEnded) -> None:
        self._send(encode_frame(FrameKind.DUPLEX_ENDED, call, ENCODER.encode(ended)))

    def _flush(self) -> None:
        self._flush_scheduled = False
        frames, self._tick = self._tick, []
        for start in range(0, len(frames), TICK_FRAMES_PER_MESSAGE):
            tick = DuplexTick(frames[start : start + TICK_FRAMES_PER_MESSAGE])
            self._send(encode_frame(FrameKind.DUPLEX_TICK, 0, ENCODER.encode(tick)))
