"""``WS /v1/realtime/video``: a prompt in, generated video out as fragmented MP4 while it is being decoded.

Client events: ``video.create`` {prompt, width, height, num_frames, fps, steps, seed, guidance_scale} (all but the
prompt optional: the model's defaults), ``video.cancel``, ``session.close``. Server: ``video.start`` {mime, width,
height, fps, num_frames, seed}, then binary messages (the fMP4 init segment, then one fragment per decoded frame
group), then ``video.done`` {status, frames, bytes, stats}; ``error`` {code, message, param} for a bad message, after
which the connection stays usable. One generation at a time per connection, several one after another.

A reader task takes client events; a stream task per generation turns the engine's frame groups into fragments
(encoded off the event loop) and returns the engine's frame credit only once a fragment is sent, so a client that
stops reading stops its own decoding.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnigate.codecs.video import FragmentedMp4Writer
from omnigate.engines.base import EngineError
from omnigate.engines.registry import load_video_engine
from omnigate.engines.video.outputs import FrameGroup, VideoDone, decoded_before_first_consumed, first_time
from omnigate.gateway.errors import UNDECODABLE, describe_validation_error, json_error
from omnigate.gateway.settings import Settings
from omnigate.gateway.speech_protocol import event_type_of
from omnigate.gateway.state import Gateway
from omnigate.sessions.registry import SessionLimitReached

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine, VideoJob

log = logging.getLogger(__name__)

TRANSPORT = "video"
# x264 speed preset: encoding a 480p frame costs 1-3 ms this way, nothing next to decoding it with the VAE.
ENCODER_PRESET = "veryfast"


class VideoCreate(msgspec.Struct, tag="video.create", forbid_unknown_fields=True, kw_only=True):
    """Start a generation; fields left out take the model's defaults (a random seed)."""

    prompt: str
    model: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    steps: int | None = None
    seed: int | None = None
    guidance_scale: float | None = None


class VideoCancel(msgspec.Struct, tag="video.cancel", forbid_unknown_fields=True):
    """Stop the generation in progress (its ``video.done`` says ``cancelled``); ignored when there is none."""


class SessionClose(msgspec.Struct, tag="session.close", forbid_unknown_fields=True):
    """Cancel what runs and close the connection normally."""


ClientEvent = VideoCreate | VideoCancel | SessionClose
CLIENT_EVENT_TYPES = ("video.create", "video.cancel", "session.close")


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
        with gateway.registry.admit(TRANSPORT):
            await ws.accept()
            await VideoStreamConnection(ws, gateway.settings, engine).run()
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
    """One accepted connection: its reader, and the stream task of the generation in progress, if any."""

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
        self.disconnected = False
        loop = asyncio.get_running_loop()
        self._session_deadline = loop.time() + settings.max_session_s

    async def run(self) -> None:
        """Serve until the client leaves, closes, idles out or stalls; then cancel and release everything."""
        self._reader = asyncio.create_task(self._read(), name="video-stream-reader")
        try:
            await asyncio.gather(self._reader, return_exceptions=True)
        finally:
            if self.job is not None:
                self.job.cancel()
            if self._stream_task is not None:
                self._stream_task.cancel()
                await asyncio.gather(self._stream_task, return_exceptions=True)
            await self._close()

    # ---- reader -----------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(None) as timeout:
                    self._receive_timeout = timeout
                    self._arm_timeout()
                    message = await self.ws.receive()
            except TimeoutError:
                expired = asyncio.get_running_loop().time() >= self._session_deadline
                reason = "max_duration" if expired else "idle_timeout"
                await self._send_json(json_error(reason, f"the session was closed: {reason.replace('_', ' ')}"))
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
                await self._error("invalid_message", "binary frames are not accepted on this endpoint; send JSON text")
                continue
            if not await self._on_text(text):
                return

    def _arm_timeout(self) -> None:
        """Idle timeout while no video is being generated; otherwise only the session's maximum duration."""
        timeout = self._receive_timeout
        if timeout is None:
            return
        deadline = self._session_deadline
        if self.job is None:
            deadline = min(deadline, asyncio.get_running_loop().time() + self.settings.idle_timeout_s)
        timeout.reschedule(deadline)

    async def _on_text(self, text: str) -> bool:
        """Handle one client event; False ends the session."""
        size = len(text.encode("utf-8"))
        if size > self.settings.ws_max_text_event_bytes:
            limit = self.settings.ws_max_text_event_bytes
            await self._error("message_too_large", f"event of {size} bytes exceeds the limit of {limit} bytes")
            return True
        try:
            event: ClientEvent = msgspec.json.decode(text, type=ClientEvent)
        except msgspec.ValidationError as exc:
            kind = event_type_of(text)
            if kind is None:
                await self._error("invalid_event", "each message must be a JSON object with a string 'type' field")
            elif kind not in CLIENT_EVENT_TYPES:
                await self._error(
                    "unknown_event", f"unknown event type {kind!r}; expected one of {list(CLIENT_EVENT_TYPES)}"
                )
            else:
                message, param = describe_validation_error(exc)
                await self._error("invalid_event", f"invalid {kind}: {message}", param)
            return True
        except UNDECODABLE:
            await self._error("invalid_json", "message is not valid JSON")
            return True
        if isinstance(event, VideoCreate):
            await self._create(event)
        elif isinstance(event, VideoCancel):
            if self.job is not None:
                self.job.cancel()
        else:
            return False
        return True

    async def _create(self, event: VideoCreate) -> None:
        if self.job is not None:
            await self._error("busy", "a video is already being generated here; send video.cancel or await video.done")
            return
        info = self.engine.info
        if event.model is not None and event.model not in (info.model, info.family):
            await self._error("model_not_found", f"model {event.model!r} is not served", "model")
            return
        request = self.engine.resolve(
            event.prompt,
            width=event.width,
            height=event.height,
            num_frames=event.num_frames,
            fps=event.fps,
            steps=event.steps,
            seed=event.seed,
            guidance_scale=event.guidance_scale,
        )
        try:
            job = self.engine.submit(request, loop=asyncio.get_running_loop())
        except EngineError as exc:
            extra: dict[str, Any] = {"retry_after": self.settings.retry_after_s} if exc.code == "server_busy" else {}
            await self._error(exc.code, exc.message, exc.param, **extra)
            return
        self.job = job
        self._stream_task = asyncio.create_task(self._stream(job), name="video-stream")

    # ---- one generation ---------------------------------------------------------------------------------------

    async def _stream(self, job: VideoJob) -> None:
        request = job.request
        frames_sent = 0
        writer: FragmentedMp4Writer | None = None
        try:
            writer = await asyncio.to_thread(
                FragmentedMp4Writer, request.width, request.height, request.fps, preset=ENCODER_PRESET
            )
            started = {
                "type": "video.start",
                "mime": writer.mime,
                "width": request.width,
                "height": request.height,
                "fps": request.fps,
                "num_frames": request.num_frames,
                "seed": request.seed,
            }
            if not (await self._send_json(started) and await self._send_bytes(writer.begin())):
                return
            while True:
                output = await job.next_output()
                if isinstance(output, FrameGroup):
                    fragment = await asyncio.to_thread(writer.push, output.frames)
                    if not await self._send_bytes(fragment):
                        return
                    frames_sent += output.count
                    job.consumed(output.count)
                    continue
                tail = await asyncio.to_thread(writer.finish)
                if tail and not await self._send_bytes(tail):
                    return
                await self._send_json(self._done_event(output, frames_sent, writer.bytes_out))
                return
        except Exception as exc:
            log.exception("video streaming failed")
            await self._send_json(
                {
                    "type": "video.done",
                    "status": "error",
                    "frames": frames_sent,
                    "bytes": 0 if writer is None else writer.bytes_out,
                    "code": "stream_error",
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
        finally:
            job.cancel()
            self.job = None
            self._arm_timeout()

    def _done_event(self, done: VideoDone, frames: int, total_bytes: int) -> dict[str, Any]:
        timeline = done.timeline
        admitted = first_time(timeline, "admitted") or 0.0
        stats: dict[str, Any] = {
            "latent_frames": done.latent_frames,
            "decoded_before_first_send": decoded_before_first_consumed(timeline),
        }
        first_sent = first_time(timeline, "consumed")
        if first_sent is not None:
            stats["first_frame_sent_ms"] = round((first_sent - admitted) * 1000.0, 1)
        ended = first_time(timeline, "done")
        if ended is not None:
            stats["total_ms"] = round((ended - admitted) * 1000.0, 1)
        body: dict[str, Any] = {
            "type": "video.done",
            "status": done.status,
            "frames": frames,
            "bytes": total_bytes,
            "stats": stats,
        }
        if done.code is not None:
            body["code"] = done.code
        if done.error is not None:
            body["error"] = done.error
        return body

    # ---- sending ----------------------------------------------------------------------------------------------

    async def _error(self, code: str, message: str, param: str | None = None, **extra: Any) -> None:
        if param is not None:
            extra["param"] = param
        await self._send_json(json_error(code, message, **extra))

    async def _send_json(self, body: dict[str, Any]) -> bool:
        return await self._send({"type": "websocket.send", "text": msgspec.json.encode(body).decode()})

    async def _send_bytes(self, data: bytes) -> bool:
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
