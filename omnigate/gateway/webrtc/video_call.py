"""One WebRTC video call: generated video played on the call's video track, driven over the ``video`` data channel.

The data channel carries exactly the events of ``WS /v1/realtime/video`` (:mod:`omnigate.gateway.video.protocol`);
``video.start`` names the track's negotiated codec as its ``mime`` (``video/VP8``, ``video/H264``), ``video.done``
has no ``bytes`` (the track's encoder is aiortc's). Decoded frames are converted in a worker thread and queued on
the track, which plays them at the requested fps; a frame's engine credit returns as it is played, so decoding
never runs more than the engine's frame credit ahead of what the peer is shown. ``video.done`` follows the last
frame played; ``video.cancel`` drops the queued frames at once.

The call ends on ``session.close``, when the peer goes away (connection failed or closed, data channel closed), when
ICE does not connect in time, on the idle timeout or the session's maximum duration, when the peer floods the
channel or stops reading it, and when the server stops; the generation is cancelled and the peer connection closed
in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription

from omnigate.engines.video.outputs import FrameGroup, VideoDone
from omnigate.gateway.errors import json_error
from omnigate.gateway.state import Gateway
from omnigate.gateway.video.generation import handle_client_text, rearm_receive_timeout, run_generation
from omnigate.gateway.video.protocol import binary_refused
from omnigate.gateway.webrtc.channel import ChannelWriter
from omnigate.gateway.webrtc.ice import rtc_configuration
from omnigate.gateway.webrtc.telemetry import END_REASONS, WebRtcTelemetry
from omnigate.gateway.webrtc.video_track import GeneratedVideoTrack, to_video_frames
from omnigate.sessions.registry import SessionLease

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine, VideoJob
    from omnigate.engines.video.request import VideoRequest

log = logging.getLogger(__name__)

TRANSPORT = "webrtc-video"
VIDEO_CHANNEL = "video"
# Client events waiting to be handled; a peer that sends more than this before they are answered is flooding.
INBOUND_EVENTS = 16
# How long an ending call waits for the cancelled generation's video.done, when the peer is there to read it.
_DONE_WAIT_S = 2.0


class TrackOutlet:
    """One generation's frames onto the call's track (the :class:`~omnigate.gateway.video.generation.FrameOutlet`
    of a video call)."""

    def __init__(self, track: GeneratedVideoTrack, mime: str) -> None:
        self._track = track
        self._mime = mime
        self._fps = 0
        self._played = 0
        self.cancelled = False

    @property
    def frames_out(self) -> int:
        return self._played

    @property
    def bytes_out(self) -> None:
        return None

    async def open(self, request: VideoRequest) -> str:
        self._fps = request.fps
        return self._mime

    async def begin(self) -> bool:
        return True

    async def deliver(self, group: FrameGroup, job: VideoJob) -> bool:
        frames = await asyncio.to_thread(to_video_frames, group.frames)
        await self._track.wait_for_room(len(frames))
        if self.cancelled:
            job.consumed(len(frames))
            return True

        def played() -> None:
            self._played += 1
            job.consumed(1)

        self._track.push(frames, self._fps, played)
        return True

    async def finish(self, done: VideoDone) -> bool:
        if done.status == "completed" and not self.cancelled:
            await self._track.wait_played()
            self._track.finish()
        else:
            self.cancel()
        return True

    def cancel(self) -> None:
        """Stop showing this generation now: queued frames are dropped, later ones never queued."""
        if not self.cancelled:
            self.cancelled = True
            self._track.clear()


class VideoCall:
    """A peer connection, its video track and the generation in progress. Create it, :meth:`answer`, :meth:`run`.

    It is also its session's :class:`~omnigate.sessions.registry.DrainTarget`: idle while nothing is generated,
    ended by the server with :meth:`end`.
    """

    def __init__(
        self, call_id: str, gateway: Gateway, lease: SessionLease, telemetry: WebRtcTelemetry, engine: VideoEngine
    ) -> None:
        self.call_id = call_id
        self.settings = gateway.settings
        self.lease = lease
        lease.drain_target = self
        self.telemetry = telemetry
        self.engine = engine
        info = engine.info
        # Its black frame is made here, on the loop: once per call, 0.4 ms at 832x480.
        self.track = GeneratedVideoTrack(info.default_width, info.default_height, info.max_frames_in_flight)
        self.pc = RTCPeerConnection(rtc_configuration(self.settings.webrtc_stun_servers))
        self.mime = "video/webrtc"  # the negotiated codec once answered
        self.job: VideoJob | None = None
        self._outlet: TrackOutlet | None = None
        self._stream_task: asyncio.Task[None] | None = None
        self._channel: ChannelWriter | None = None
        self._inbound: asyncio.Queue[str | bytes] = asyncio.Queue(INBOUND_EVENTS)
        self._send_lock = asyncio.Lock()
        self._receive_timeout: asyncio.Timeout | None = None
        self._discards: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._ended = asyncio.Event()
        self.end_reason = "client_disconnected"
        self._end_error: tuple[str, str] | None = None
        loop = asyncio.get_running_loop()
        self._created = loop.time()
        self._session_deadline = self._created + self.settings.max_session_s
        self._closed = False

    # ---- signalling -------------------------------------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """Apply the client's offer and return the answer SDP (host candidates included: no trickle)."""
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_connection_state)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        self.pc.addTrack(self.track)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        description = self.pc.localDescription
        assert description is not None
        self.mime = _video_mime(description.sdp) or self.mime
        loop = asyncio.get_running_loop()
        self._timers = [loop.call_later(self.settings.webrtc_ice_timeout_s, self._on_ice_deadline)]
        return description.sdp

    # ---- lifetime ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the call until it ends, then cancel the generation and close everything. Never raises."""
        reader = asyncio.create_task(self._read(), name=f"video-call-reader-{self.call_id}")
        reader.add_done_callback(lambda _task: self._ended.set())
        try:
            await self._ended.wait()
        finally:
            reader.cancel()
            [outcome] = await asyncio.gather(reader, return_exceptions=True)
            if isinstance(outcome, Exception):
                log.error("video call reader failed", exc_info=outcome)
                self.end_reason = "internal_error"
            try:
                await self._end_generation()
                if self._end_error is not None:
                    await self.send_event(json_error(*self._end_error))
                if self._channel is not None:
                    await self._channel.flush()
            except Exception:
                log.exception("ending a video call failed")
            finally:
                await self.close()

    def stop(self, reason: str) -> None:
        """End the call from outside (server shutdown); :meth:`run` then closes it."""
        self._end(reason, reason, f"the session ended: {reason}")

    @property
    def idle(self) -> bool:
        """No video is being generated."""
        return self.job is None

    def end(self, code: str, message: str) -> bool:
        """End the call from the server's side: the generation in progress, if any, is cancelled (its ``video.done``
        still goes out), then an ``error`` with ``code`` on the channel, and the call is closed. False when the call
        is already ending."""
        if self._ended.is_set():
            return False
        self._end(code, code, message)
        return True

    def _end(self, reason: str, code: str | None = None, message: str | None = None) -> None:
        """End the call (the first reason wins), telling the peer ``code`` when given."""
        if self._ended.is_set():
            return
        self.end_reason = reason
        if code is not None:
            self._end_error = (code, message or reason)
        self._ended.set()

    async def _end_generation(self) -> None:
        """Cancel the generation in progress; let it send its video.done while the peer is there to read it."""
        self.cancel_generation()
        task = self._stream_task
        if task is None:
            return
        if self._channel is not None and self._channel.channel.readyState == "open":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), _DONE_WAIT_S)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Close the peer connection and free the session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        if self.job is not None:
            self.job.cancel()
        self.lease.release()
        self.telemetry.calls_ended.labels(self.end_reason if self.end_reason in END_REASONS else "other").inc()
        self.track.stop()
        try:
            await self.pc.close()
        finally:
            for task in self._discards:
                task.cancel()
            await asyncio.gather(*self._discards, return_exceptions=True)

    # ---- peer connection events -------------------------------------------------------------------------------

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.telemetry.connect_seconds.observe(asyncio.get_running_loop().time() - self._created)
        elif state in ("failed", "closed"):
            self._end("client_disconnected")

    def _on_ice_deadline(self) -> None:
        if self.pc.connectionState != "connected" and not self._ended.is_set():
            self.telemetry.ice_timeouts.inc()
            timeout = self.settings.webrtc_ice_timeout_s
            self._end("ice_timeout", "ice_timeout", f"the peer connection did not connect within {timeout:g} s")

    def _on_track(self, track: MediaStreamTrack) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(_discard(track))
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != VIDEO_CHANNEL or self._channel is not None:
            channel.close()
            return
        self._channel = ChannelWriter(channel, self.settings.stall_timeout_s)

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            try:
                self._inbound.put_nowait(message)
            except asyncio.QueueFull:
                self._end("backlog", "backlog", f"more than {INBOUND_EVENTS} events waiting; send fewer at a time")

        @channel.on("close")
        def on_close() -> None:
            self._end("client_disconnected")

    # ---- client events ----------------------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(None) as timeout:
                    self._receive_timeout = timeout
                    rearm_receive_timeout(
                        self._receive_timeout, self._session_deadline, self.job is not None, self.settings
                    )
                    message = await self._inbound.get()
            except TimeoutError:
                expired = asyncio.get_running_loop().time() >= self._session_deadline
                reason = "max_duration" if expired else "idle_timeout"
                self._end(reason, reason, f"the session was closed: {reason.replace('_', ' ')}")
                return
            finally:
                self._receive_timeout = None
            if isinstance(message, bytes):
                await self.send_event(binary_refused().event())
            elif not await handle_client_text(self, self.engine, message, self.settings):
                self._end("client_closed")
                return

    def start_generation(self, job: VideoJob) -> None:
        """Play ``job`` on the track from a stream task of its own (the ``VideoSession`` part of this call)."""
        self.job = job
        self._outlet = TrackOutlet(self.track, self.mime)
        self._stream_task = asyncio.create_task(self._stream(job, self._outlet), name=f"video-call-{self.call_id}")

    def cancel_generation(self) -> None:
        """Cancel the generation in progress, if any, and stop showing its frames at once."""
        if self.job is not None:
            self.job.cancel()
        if self._outlet is not None:
            self._outlet.cancel()

    async def _stream(self, job: VideoJob, outlet: TrackOutlet) -> None:
        try:
            await run_generation(job, outlet, self.send_event)
        finally:
            self.job = None
            self._outlet = None
            rearm_receive_timeout(self._receive_timeout, self._session_deadline, self.job is not None, self.settings)

    async def send_event(self, body: dict[str, Any]) -> bool:
        """Send one event on the data channel; False when the peer is gone or stopped reading."""
        if self._channel is None:
            return True  # nothing was asked yet, so there is nobody to tell
        async with self._send_lock:
            result = await self._channel.send(msgspec.json.encode(body).decode())
        if result == "closed":
            self._end("client_disconnected")
        elif result == "stalled":
            log.info("closing a WebRTC video call whose data channel is stalled")
            self._end("stalled")
        return result == "sent"


def _video_mime(answer_sdp: str) -> str | None:
    """The codec the answer sends video with (``video/VP8``), or None when it has no video section."""
    for media in SessionDescription.parse(answer_sdp).media:
        if media.kind == "video" and media.rtp.codecs:
            mime: str = media.rtp.codecs[0].mimeType
            return mime
    return None


async def _discard(track: MediaStreamTrack) -> None:
    """Read a track nobody uses, so aiortc's queue for it stays empty."""
    while True:
        try:
            await track.recv()
        except MediaStreamError:
            return
