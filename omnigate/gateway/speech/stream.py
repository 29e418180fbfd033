"""``WS /v1/audio/speech/stream``: incremental text in, audio out, several utterances per connection.

The adapter only translates: client events become session commands, session events become wire events. A reader
task and a writer task run concurrently, so a disconnect is seen at once (not at the next failed send) and a slow
client blocks only its own writer, which stops granting engine credit.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.codecs.encoder import complete_wav
from omnigate.engines.base import EngineError
from omnigate.engines.pool import PoolClosed, PoolFull
from omnigate.engines.pool_api import EnginePoolAPI
from omnigate.engines.remote.pool import PinnedView, RemoteEnginePool
from omnigate.gateway.errors import json_error
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.security.client_session import minted_session, stored_session_event
from omnigate.gateway.speech.adapter import (
    INTERNAL_ERROR,
    SpeechInput,
    audio_done_event,
    audio_start_event,
    error_event,
    fail_session,
    session_done_event,
)
from omnigate.gateway.speech.audio_out import AudioOut
from omnigate.gateway.state import Gateway
from omnigate.gateway.task_pair import park, run_reader_writer
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import (
    ErrorEvent,
    MediaChunk,
    SegmentDone,
    SegmentStarted,
    SessionClosed,
    UtteranceDone,
)
from omnigate.sessions.registry import SessionLimitReached

log = logging.getLogger(__name__)

TRANSPORT = "ws-speech"

# Close codes by the reason a session ended.
CLOSE_CODES = {
    "client_closed": 1000,
    "idle_timeout": 4408,
    "config_timeout": 4408,
    "max_duration": 1008,
    "stalled": 1008,
    "shutting_down": 1012,
    INTERNAL_ERROR: 1011,
}


async def speech_stream_endpoint(ws: WebSocket) -> None:
    gateway: Gateway = ws.app.state.gateway
    metrics: Metrics = ws.app.state.metrics
    if gateway.pool is None:
        await _refuse(ws, "not_ready", "the engine is not loaded yet", 1013, gateway.settings.retry_after_s)
        return
    place: PinnedView | None = None
    try:
        with gateway.registry.admit(TRANSPORT) as lease:
            if isinstance(gateway.pool, RemoteEnginePool):
                # The engine runs in another process that other gateway processes share: it admits the session
                # itself (a place it holds until the session ends), never this process's last view of it.
                try:
                    place = await gateway.pool.reserve_session()
                except PoolFull as exc:
                    message = "the engine has no room for another session; retry shortly"
                    await _refuse(ws, "engine_busy", message, 1013, exc.retry_after_s)
                    return
                except PoolClosed:
                    message = "the server is shutting down"
                    await _refuse(ws, "shutting_down", message, 1012, gateway.settings.retry_after_s)
                    return
                except EngineError:
                    # No engine reachable now (a restarted core, not seen yet): no admission was decided, and the
                    # session's utterances meet the engine's own refusal, or its typed unavailability, at open.
                    pass
            elif gateway.settings.admission == "headroom" and not gateway.pool.has_free_slot():
                # No headroom: a new session would make the admitted ones late (sessions already here keep theirs).
                message = "the engine has no headroom for another session; retry shortly"
                await _refuse(ws, "engine_busy", message, 1013, gateway.settings.retry_after_s)
                return
            await ws.accept()
            connection = SpeechStreamConnection(ws, gateway, metrics, place)
            lease.driver = connection.driver
            minted = stored_session_event(minted_session(ws.scope), "speech")
            if minted is not None:
                connection.input.on_text(minted)  # the configuration minted with the client secret
            await connection.run()
    except SessionLimitReached as exc:
        code = "shutting_down" if gateway.registry.draining else "server_busy"
        await _refuse(ws, code, str(exc), 1012 if gateway.registry.draining else 1013, exc.retry_after_s)
    finally:
        if place is not None:
            place.unpin()  # the engine frees the session's place


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int, retry_after_s: float) -> None:
    await ws.accept()
    await ws.send_json(json_error(code, message, retry_after=retry_after_s))
    await ws.close(close_code, f"{code}; retry after {retry_after_s:g}s")


class SpeechStreamConnection:
    """One accepted connection: a reader, a writer and the session driver between them."""

    def __init__(self, ws: WebSocket, gateway: Gateway, metrics: Metrics, place: PinnedView | None = None) -> None:
        """``place``: the session's view of a remote engine that holds a place for it, if it was admitted so."""
        assert gateway.pool is not None
        self.ws = ws
        self.gateway = gateway
        self.settings = gateway.settings
        self.pool: EnginePoolAPI[Any] = place if place is not None else gateway.pool
        self.metrics = metrics
        self.driver = SessionDriver(
            self.pool,
            gateway.limits(self.settings.ws_outbox_ms),
            on_first_audio=lambda ms: metrics.ttfa.labels(TRANSPORT).observe(ms / 1000.0),
        )
        self.input = SpeechInput(self.driver, gateway)
        self.disconnected = False

    async def run(self) -> None:
        try:
            failure = await run_reader_writer(self._read(), self._write(), "speech-stream")
            if failure is not None:
                await self._end_failed()
        finally:
            self.driver.release()

    async def _end_failed(self) -> None:
        """The reader or the writer died: the client gets a typed error and its utterances' ends, then close 1011."""
        events = fail_session(self.driver, "the server failed while serving this session; retry")
        for body in events:
            if not await self._send_json(body):
                return
        await self._close(SessionClosed(INTERNAL_ERROR, INTERNAL_ERROR))

    # ---- reader -----------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        config_deadline = loop.time() + self.settings.config_timeout_s
        while True:
            try:
                if self.driver.session.config is None:
                    async with asyncio.timeout_at(config_deadline):
                        message = await self.ws.receive()
                else:
                    message = await self.ws.receive()
            except TimeoutError:
                self.driver.fail("config_timeout", "no session.config within the config timeout")
                await park()
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                self.driver.abort("client_disconnected")
                return
            text = message.get("text")
            if text is None:
                self.input.error("invalid_message", "binary frames are not accepted on this endpoint; send JSON text")
                continue
            self.input.on_text(text)
            if self.driver.closed:
                await park()

    # ---- writer -----------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        self._out: AudioOut | None = None
        try:
            await self._write_events()
        finally:
            if self._out is not None:
                self._out.close()

    async def _write_events(self) -> None:
        held: list[bytes] = []
        while True:
            out = self._out
            event = await self.driver.next_event()
            if isinstance(event, MediaChunk):
                if out is None:
                    continue
                self.metrics.outbox_lag.labels(TRANSPORT).observe(self.driver.outbox.media_ms / 1000.0)
                data = await out.encode(event.pcm)
                if self.input.output.stream_audio:
                    if data and not await self._send_bytes(data):
                        return
                elif data:
                    held.append(data)
            elif isinstance(event, SegmentStarted):
                self.input.writing = True
                if out is not None:
                    out.close()
                output = self.input.output
                out = self._out = await AudioOut.open(output.response_format, event.sample_rate, output.sample_rate)
                held = []
                if not await self._send_json(audio_start_event(event, output.response_format, out.output_rate)):
                    return
            elif isinstance(event, SegmentDone):
                total = 0
                if out is not None:
                    tail = await out.finish()
                    payload = tail if self.input.output.stream_audio else b"".join([*held, tail])
                    if not self.input.output.stream_audio and self.input.output.response_format == "wav":
                        payload = complete_wav(payload)  # a whole file per sentence: real sizes in the header
                    if payload and not await self._send_bytes(payload):
                        return
                    total = out.bytes_out
                self._out, held = None, []
                self.input.writing = False
                if not await self._send_json(audio_done_event(event, total)):
                    return
            elif isinstance(event, UtteranceDone):
                if not await self._send_json(session_done_event(event)):
                    return
            elif isinstance(event, ErrorEvent):
                if not await self._send_json(error_event(event)):
                    return
            elif isinstance(event, SessionClosed):
                await self._close(event)
                return

    async def _send_json(self, body: dict[str, Any]) -> bool:
        return await self._send({"type": "websocket.send", "text": msgspec.json.encode(body).decode()})

    async def _send_bytes(self, data: bytes) -> bool:
        return await self._send({"type": "websocket.send", "bytes": data})

    async def _send(self, message: dict[str, Any]) -> bool:
        """Send one message; a client that accepts nothing for the stall timeout is dropped."""
        if self.disconnected:
            return False
        try:
            async with asyncio.timeout(self.settings.stall_timeout_s):
                await self.ws.send(message)
        except TimeoutError:
            log.info("closing a stalled speech-stream client")
            self.disconnected = True
            self.driver.abort("stalled", "stalled")
            return False
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.disconnected = True
            self.driver.abort("client_disconnected")
            return False
        return True

    async def _close(self, event: SessionClosed) -> None:
        if self.disconnected:
            return
        code = CLOSE_CODES.get(event.reason, 1000)
        try:
            async with asyncio.timeout(1.0):
                await self.ws.close(code, event.reason[:120])
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            pass
