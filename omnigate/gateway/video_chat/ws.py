"""``WS /v1/video/chat/stream``: camera frames and microphone audio in, answers as streamed text and speech out.

A reader decodes client events and hands them to the session's runner (frames go to its decoder, off the event
loop); a writer sends the runner's events as the protocol's JSON. The idle timeout counts only while no query is
being answered (frames alone do not keep a session alive forever: the session's maximum duration still applies).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.gateway.errors import json_error
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.gateway.task_pair import park, run_reader_writer
from omnigate.gateway.video_chat.frames import FrameDecodePool
from omnigate.gateway.video_chat.protocol import (
    AudioChunkEvent,
    PingEvent,
    ProtocolError,
    SessionConfigEvent,
    VideoDoneEvent,
    VideoFrameEvent,
    VideoQueryEvent,
    check_base64_size,
    decode_base64,
    decode_client_event,
    event_json,
    merged_config,
)
from omnigate.gateway.video_chat.runner import Closed, ThinkEngine, VideoChatRunner
from omnigate.sessions.registry import SessionLimitReached
from omnigate.sessions.video_chat import ResponseAudioDone, ResponseTextDone, VideoChatLimits

log = logging.getLogger(__name__)

TRANSPORT = "video-chat"
UNAVAILABLE = (
    "this gateway serves no omni model (start it with --omni-model, or serve --engine qwen3-omni with the engine in "
    "its process: --engine-process inline)"
)
CLOSE_CODES = {
    "client_done": 1000,
    "client_disconnected": 1000,
    "idle_timeout": 4408,
    "max_duration": 1008,
    "backlog": 1008,
    "stalled": 1008,
    "shutting_down": 1012,
    "internal_error": 1011,
}


def omni_engine(ws: WebSocket) -> ThinkEngine | None:
    engine: ThinkEngine | None = getattr(ws.app.state, "omni_engine", None)
    return engine


def frame_decoding(app: Any) -> FrameDecodePool:
    """The server's frame decode pool (``app.state.frame_decoding``)."""
    pool: FrameDecodePool = app.state.frame_decoding
    return pool


def chat_limits(gateway: Gateway) -> VideoChatLimits:
    return VideoChatLimits(max_question_chars=gateway.settings.max_input_chars)


async def video_chat_endpoint(ws: WebSocket) -> None:
    gateway: Gateway = ws.app.state.gateway
    engine = omni_engine(ws)
    if engine is None:
        await _refuse(ws, "video_chat_unavailable", UNAVAILABLE, 4404)
        return
    if gateway.pool is None:
        await _refuse(ws, "not_ready", "the engine is not loaded yet", 1013)
        return
    try:
        with gateway.registry.admit(TRANSPORT) as lease:
            await ws.accept()
            connection = VideoChatConnection(ws, gateway, engine, frame_decoding(ws.app))
            lease.drain_target = connection
            await connection.run()
    except SessionLimitReached as exc:
        draining = gateway.registry.draining
        code = "shutting_down" if draining else "server_busy"
        await _refuse(ws, code, str(exc), 1012 if draining else 1013, exc.retry_after_s)


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int, retry_after_s: float | None = None) -> None:
    extra = {} if retry_after_s is None else {"retry_after": retry_after_s}
    await ws.accept()
    await ws.send_json(json_error(code, message, **extra))
    await ws.close(close_code, code)


def handle_client_text(runner: VideoChatRunner, text: str, settings: Settings) -> None:
    """One client event of either transport; a bad one is answered with a typed ``error``."""
    try:
        event = decode_client_event(text)
        if isinstance(event, VideoFrameEvent):
            # Decoded from base64 with the picture, on the frame pool: a frame refused for backpressure costs nothing.
            check_base64_size(event.data, "data", runner.frame_budget.max_bytes)
            runner.frame(event.data)
        elif isinstance(event, AudioChunkEvent):
            runner.audio(decode_base64(event.data, "data", settings.ws_max_message_bytes))
        elif isinstance(event, VideoQueryEvent):
            audio = None
            if event.audio_data is not None:
                audio = decode_base64(event.audio_data, "audio_data", settings.ws_max_message_bytes)
            runner.query(event.text, audio)
        elif isinstance(event, SessionConfigEvent):
            try:
                config = merged_config(runner.config, event)
            except (TypeError, msgspec.ValidationError) as exc:
                raise ProtocolError("invalid_config", str(exc)) from None
            runner.configure(config)
        elif isinstance(event, VideoDoneEvent):
            runner.done()
        elif isinstance(event, PingEvent):
            runner.pong()
    except ProtocolError as exc:
        runner.error(exc.code, exc.message, exc.param)


class VideoChatConnection:
    """One accepted connection; also the session's drain target (idle while no query is answered)."""

    def __init__(self, ws: WebSocket, gateway: Gateway, engine: ThinkEngine, frames: FrameDecodePool) -> None:
        assert gateway.pool is not None
        self.ws = ws
        self.settings = gateway.settings
        self.runner = VideoChatRunner(
            engine, gateway.pool, frames, gateway.limits(self.settings.ws_outbox_ms), chat_limits(gateway)
        )
        self.disconnected = False
        self._receive_timeout: asyncio.Timeout | None = None
        self._session_deadline = asyncio.get_running_loop().time() + self.settings.max_session_s

    async def run(self) -> None:
        try:
            await run_reader_writer(self._read(), self._write(), "video-chat")
        finally:
            await self.runner.close()

    @property
    def idle(self) -> bool:
        return not self.runner.answering

    def end(self, code: str, message: str) -> bool:
        if self.runner.closed:
            return False
        self.runner.fail(code, message)
        return True

    # ---- reader -----------------------------------------------------------------------------------------------

    def _rearm(self) -> None:
        timeout = self._receive_timeout
        if timeout is None:
            return
        deadline = self._session_deadline
        if not self.runner.answering:
            deadline = min(deadline, asyncio.get_running_loop().time() + self.settings.idle_timeout_s)
        timeout.reschedule(deadline)

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(None) as timeout:
                    self._receive_timeout = timeout
                    self._rearm()
                    message = await self.ws.receive()
            except TimeoutError:
                expired = asyncio.get_running_loop().time() >= self._session_deadline
                reason = "max_duration" if expired else "idle_timeout"
                self.runner.fail(reason, f"the session was closed: {reason.replace('_', ' ')}")
                await park()
            finally:
                self._receive_timeout = None
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                self.runner.abort("client_disconnected")
                return
            text = message.get("text")
            if text is None:
                self.runner.error("invalid_message", "binary frames are not accepted on this endpoint; send JSON text")
                continue
            handle_client_text(self.runner, text, self.settings)
            if self.runner.closed:
                await park()

    # ---- writer -----------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        while True:
            event = await self.runner.next_event()
            if isinstance(event, Closed):
                await self._close(event.reason)
                return
            body = event_json(event, self.runner.config.audio_format)
            if not await self._send(body):
                return
            if isinstance(event, (ResponseAudioDone, ResponseTextDone)):
                self._rearm()

    async def _send(self, body: dict[str, Any]) -> bool:
        if self.disconnected:
            return False
        try:
            async with asyncio.timeout(self.settings.stall_timeout_s):
                await self.ws.send({"type": "websocket.send", "text": msgspec.json.encode(body).decode()})
        except TimeoutError:
            log.info("closing a stalled video-chat client")
            self.disconnected = True
            self.runner.abort("stalled")
            return False
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.disconnected = True
            self.runner.abort("client_disconnected")
            return False
        return True

    async def _close(self, reason: str) -> None:
        if self.disconnected:
            return
        try:
            async with asyncio.timeout(1.0):
                await self.ws.close(CLOSE_CODES.get(reason, 1000), reason[:120])
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            pass
