"""``WS /v1/realtime/video``: a prompt in, generated video out as fragmented MP4 while it is being decoded.

The events are those of :mod:`omnigate.gateway.video.protocol`; the video itself comes as binary messages between
``video.start`` and ``video.done``: the fMP4 init segment, then one fragment per decoded frame group. One generation
at a time per connection, several one after another.

A reader task takes client events; a stream task per generation turns the engine's frame groups into fragments
(encoded off the event loop) and returns the engine's frame credit only once a fragment is sent, so a client that
stops reading stops its own decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.codecs.video import FragmentedMp4Writer
from omnigate.engines.registry import load_video_engine
from omnigate.engines.video.outputs import FrameGroup, VideoDone
from omnigate.gateway.errors import json_error
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.gateway.video.generation import handle_client_text, rearm_receive_timeout, run_generation
from omnigate.gateway.video.protocol import binary_refused
from omnigate.sessions.registry import SessionLimitReached

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine, VideoJob
    from omnigate.engines.video.request import VideoRequest

log = logging.getLogger(__name__)

TRANSPORT = "video"
# x264 speed preset: encoding a 480p frame costs 1-3 ms this way, nothing next to decoding it with the VAE.
ENCODER_PRESET = "veryfast"
# The close code of a session the server ends (a drain): 1012, service restart.
SERVER_END_CLOSE_CODE = 1012
# How long an ending session waits for the cancelled generation's video.done, when the client is there to read it.
_DONE_WAIT_S = 2.0


def _engine(ws: WebSocket) -> VideoEngine | None:
    engine: VideoEngine | None = getattr(ws.app.state, "video_engine", None)
    return engine


async def start_video_engine(settings: Settings) -> VideoEngine | None:
    """Load and start the video engine when ``--video-model`` names one (off the event loop: it builds a model)."""
    if not settings.video_model:
        return None
    engine = await asyncio.to_thread(load_video_engine, settings.video_model, **settings.video_options)
    engine.start()
    log.info(
        "video engine %s ready: %d slots%s",
        engine.info.model,
        engine.info.max_sessions,
        " (random weights: noise, not video)" if engine.info.random_weights else "",
    )
    return engine


async def stop_video_engine(engine: VideoEngine | None) -> None:
    """Cancel its generations and join its worker (off the event loop: a step may be running)."""
    if engine is not None:
        await asyncio.to_thread(engine.stop)


async def video_stream_endpoint(ws: WebSocket) -> None:
    """Admit the connection (transport ``video``) and serve it, or refuse it typed before any work."""
    gateway: Gateway = ws.app.state.gateway
    engine = _engine(ws)
    if engine is None:
        await _refuse(ws, "video_unavailable", "this gateway serves no video model (start it with --video-model)", 4404)
        return
    try:
        with gateway.registry.admit(TRANSPORT) as lease:
            await ws.accept()
            connection = VideoStreamConnection(ws, gateway.settings, engine)
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


class VideoStreamConnection:
    """One accepted connection: its reader, and the stream task of the generation in progress, if any.

    It is also the session's :class:`~omnigate.sessions.registry.DrainTarget`: idle while nothing is generated,
    ended by the server with :meth:`end`.
    """

    def __init__(self, ws: WebSocket, settings: Settings, engine: VideoEngine) -> None:
        self.ws = ws
        self.settings = settings
        self.engine = engine
        self.job: VideoJob | None = None
        self._stream_task: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._receive_timeout: asyncio.Timeout | None = None
        self._close_code = 1000
        self._close_reason = "client_closed"
        self._end_error: tuple[str, str] | None = None
        self.disconnected = False
        loop = asyncio.get_running_loop()
        self._session_deadline = loop.time() + settings.max_session_s

    async def run(self) -> None:
        """Serve until the client leaves, closes, idles out or stalls; then cancel and release everything."""
        self._reader = asyncio.create_task(self._read(), name="video-stream-reader")
        try:
            await asyncio.gather(self._reader, return_exceptions=True)
        finally:
            await self._end_generation()
            if self._end_error is not None:
                await self.send_event(json_error(*self._end_error))
            await self._close()

    @property
    def idle(self) -> bool:
        """No video is being generated."""
        return self.job is None

    def end(self, code: str, message: str) -> bool:
        """End the session from the server's side: the generation in progress, if any, is cancelled (its
        ``video.done`` still goes out), then an ``error`` with ``code`` and the close (1012). False when the session
        is already ending."""
        reader = self._reader
        if self._end_error is not None or self.disconnected or reader is None or reader.done():
            return False
        self._end_error = (code, message)
        self._close_code, self._close_reason = SERVER_END_CLOSE_CODE, code
        reader.cancel()
        return True

    async def _end_generation(self) -> None:
        """Cancel the generation in progress; let it send its video.done while the client is there to read it."""
        self.cancel_generation()
        task = self._stream_task
        if task is None:
            return
        if not self.disconnected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), _DONE_WAIT_S)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # ---- reader -----------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(None) as timeout:
                    self._receive_timeout = timeout
                    rearm_receive_timeout(
                        self._receive_timeout, self._session_deadline, self.job is not None, self.settings
                    )
                    message = await self.ws.receive()
            except TimeoutError:
                expired = asyncio.get_running_loop().time() >= self._session_deadline
                reason = "max_duration" if expired else "idle_timeout"
                await self.send_event(json_error(reason, f"the session was closed: {reason.replace('_', ' ')}"))
                self._close_code, self._close_reason = (1008 if expired else 4408), reason
                return
            finally:
                self._receive_timeout = None
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                self._close_reason = "client_disconnected"
                return
            text = message.get("text")
            if text is None:
                await self.send_event(binary_refused().event())
                continue
            if not await handle_client_text(self, self.engine, text, self.settings):
                return

    def start_generation(self, job: VideoJob) -> None:
        """Serve ``job`` in a stream task of its own (the ``VideoSession`` part of this connection)."""
        self.job = job
        self._stream_task = asyncio.create_task(self._stream(job), name="video-stream")

    def cancel_generation(self) -> None:
        """Cancel the generation in progress, if any."""
        if self.job is not None:
            self.job.cancel()

    async def _stream(self, job: VideoJob) -> None:
        try:
            await run_generation(job, Mp4Outlet(self), self.send_event)
        finally:
            self.job = None
            rearm_receive_timeout(self._receive_timeout, self._session_deadline, self.job is not None, self.settings)

    # ---- sending ----------------------------------------------------------------------------------------------

    async def send_event(self, body: dict[str, Any]) -> bool:
        """Send one JSON event; False once the client is gone."""
        return await self._send({"type": "websocket.send", "text": msgspec.json.encode(body).decode()})

    async def send_bytes(self, data: bytes) -> bool:
        """Send one binary message; False once the client is gone."""
        return await self._send({"type": "websocket.send", "bytes": data}) if data else True

    async def _send(self, message: dict[str, Any]) -> bool:
        """Send one message; a client that takes nothing for the stall timeout is dropped."""
        if self.disconnected:
            return False
        try:
            async with self._send_lock, asyncio.timeout(self.settings.stall_timeout_s):
                await self.ws.send(message)
        except TimeoutError:
            log.info("closing a stalled video client")
            self._drop(1008, "stalled")
            return False
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._drop(1000, "client_disconnected")
            return False
        return True

    def _drop(self, code: int, reason: str) -> None:
        """End the session from the sending side: the reader stops, :meth:`run` cleans up."""
        self.disconnected = True
        self._close_code, self._close_reason = code, reason
        if self._reader is not None:
            self._reader.cancel()

    async def _close(self) -> None:
        if self.disconnected and self._close_reason == "client_disconnected":
            return
        try:
            async with asyncio.timeout(1.0):
                await self.ws.close(self._close_code, self._close_reason)
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            pass


class Mp4Outlet:
    """A generation's frames as fragmented MP4 on the connection: the init segment, then a fragment per group."""

    def __init__(self, connection: VideoStreamConnection) -> None:
        self._connection = connection
        self._writer: FragmentedMp4Writer | None = None
        self._frames = 0

    @property
    def frames_out(self) -> int:
        return self._frames

    @property
    def bytes_out(self) -> int:
        return 0 if self._writer is None else self._writer.bytes_out

    async def open(self, request: VideoRequest) -> str:
        self._writer = await asyncio.to_thread(
            FragmentedMp4Writer, request.width, request.height, request.fps, preset=ENCODER_PRESET
        )
        return self._writer.mime

    async def begin(self) -> bool:
        assert self._writer is not None
        return await self._connection.send_bytes(self._writer.begin())

    async def deliver(self, group: FrameGroup, job: VideoJob) -> bool:
        assert self._writer is not None
        fragment = await asyncio.to_thread(self._writer.push, group.frames)
        if not await self._connection.send_bytes(fragment):
            return False
        self._frames += group.count
        job.consumed(group.count)
        return True

    async def finish(self, done: VideoDone) -> bool:
        assert self._writer is not None
        tail = await asyncio.to_thread(self._writer.finish)
        return not tail or await self._connection.send_bytes(tail)
