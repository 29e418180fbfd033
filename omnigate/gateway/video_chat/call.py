"""``POST /v1/video/chat/calls``: live video chat over WebRTC.

The browser sends its camera and microphone tracks; the answer's speech comes back on an audio track (20 ms Opus
packets) and every other event of the WebSocket protocol (``response.start``, text deltas, terminals, errors) on
the data channel ``video-chat``, which also takes the client's events (``session.config``, ``video.query`` for a
typed question, ``video.done``). Camera frames are taken at ``CAMERA_FPS`` at most (the ring samples from them; the
rest are not decoded). Server VAD ends a spoken question: microphone audio is kept only while someone speaks
(with a short lead-in), and the end of speech asks the question with that audio.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Any

import av
import msgspec
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from starlette.requests import Request
from starlette.responses import Response

from omnigate.codecs.resample import StreamResampler
from omnigate.codecs.rtc_audio import RTC_SAMPLE_RATE, RtcOpusStream
from omnigate.engines.omni.request import AUDIO_RATE
from omnigate.gateway.errors import HttpError
from omnigate.gateway.state import Gateway
from omnigate.gateway.video_chat.frames import FrameDecodePool
from omnigate.gateway.video_chat.protocol import event_json
from omnigate.gateway.video_chat.runner import Closed, ThinkEngine, VideoChatRunner
from omnigate.gateway.video_chat.ws import UNAVAILABLE, chat_limits, frame_decoding, handle_client_text
from omnigate.gateway.webrtc.channel import ChannelWriter
from omnigate.gateway.webrtc.ice import rtc_configuration
from omnigate.gateway.webrtc.microphone import consume_microphone
from omnigate.gateway.webrtc.signalling import WebRtcCalls, admit_call, answer_call, read_offer
from omnigate.gateway.webrtc.telemetry import WebRtcTelemetry
from omnigate.gateway.webrtc.track import DEFAULT_LEAD_FRAMES, SpeechTrack
from omnigate.sessions.registry import SessionLease
from omnigate.sessions.video_chat import ResponseAudioDelta, ResponseAudioDone

if TYPE_CHECKING:
    from omnigate.engines.vad import SpeechProbability

log = logging.getLogger(__name__)

TRANSPORT = "webrtc-video-chat"
CHANNEL = "video-chat"
CALLS_PATH = "/v1/video/chat/calls"
CAMERA_FPS = 2.0
SPEECH_START = 0.5  # a VAD window this likely to be speech starts a spoken question
SPEECH_END = 0.35  # ... and this many windows below this end it
END_WINDOWS = 20  # 20 x 32 ms: 640 ms of silence
LEAD_IN_WINDOWS = 10  # audio kept from before the speech started (its first syllable)
MAX_UNHEARD_BYTES = RTC_SAMPLE_RATE * 2 * 2  # 2 s of 48 kHz microphone audio waiting for the VAD; more is dropped


class SpokenQuestions:
    """Server VAD over the microphone (sans-I/O): 48 kHz in, finished questions (16 kHz s16le) out."""

    def __init__(self, vad: SpeechProbability, max_bytes: int) -> None:
        self._vad = vad
        self._resampler = StreamResampler(RTC_SAMPLE_RATE, AUDIO_RATE)
        self._lead: list[bytes] = []
        self._speech = bytearray()
        self._speaking = False
        self._quiet = 0
        self._max_bytes = max_bytes

    def push(self, pcm48: bytes) -> bytes | None:
        """Audio from the microphone; the question's audio once its speech has ended, else None."""
        audio = self._resampler.process(pcm48)
        probabilities = self._vad.process(pcm48)
        if self._speaking:
            self._speech += audio
        else:
            self._lead.append(audio)
            del self._lead[:-LEAD_IN_WINDOWS]
        for p in probabilities:
            if not self._speaking and p >= SPEECH_START:
                self._speaking, self._quiet = True, 0
                self._speech = bytearray(b"".join(self._lead))
                self._lead.clear()
            elif self._speaking:
                self._quiet = self._quiet + 1 if p < SPEECH_END else 0
        if self._speaking and (self._quiet >= END_WINDOWS or len(self._speech) >= self._max_bytes):
            question = bytes(self._speech[: self._max_bytes])
            self._speaking, self._speech = False, bytearray()
            return question
        return None


class VideoChatCall:
    """A peer connection bound to one video-chat session. Create it, :meth:`answer`, :meth:`run`."""

    def __init__(
        self,
        call_id: str,
        gateway: Gateway,
        lease: SessionLease,
        telemetry: WebRtcTelemetry,
        engine: ThinkEngine,
        frames: FrameDecodePool,
        vad: SpeechProbability,
    ) -> None:
        assert gateway.pool is not None
        self.call_id = call_id
        self.settings = gateway.settings
        self.lease = lease
        self.telemetry = telemetry
        limits = chat_limits(gateway)
        self.track = SpeechTrack(lambda: self.runner.session.latest_query, DEFAULT_LEAD_FRAMES)
        speech_limits = gateway.limits(self.settings.webrtc_outbox_ms)
        # However the session ends, the writer must not wait for room on a track that may not be playing.
        self.runner = VideoChatRunner(engine, gateway.pool, frames, speech_limits, limits, on_closed=self.track.wake)
        lease.drain_target = self
        self.questions = SpokenQuestions(vad, limits.max_audio_bytes)
        self.pc = RTCPeerConnection(rtc_configuration(self.settings.webrtc_stun_servers))
        self._channel: ChannelWriter | None = None
        self._heard = bytearray()  # microphone audio the VAD has not heard yet
        self._listener: asyncio.Future[None] | None = None
        self._inbound: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._end_reason = "client_disconnected"
        self._closed = False

    # ---- drain target -----------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.runner.answering

    def end(self, code: str, message: str) -> bool:
        if self.runner.closed:
            return False
        self.runner.fail(code, message)
        self.track.wake()
        return True

    def stop(self, reason: str) -> None:
        """End the session from outside (server shutdown)."""
        self.runner.fail(reason, "the server is shutting down")
        self.track.wake()

    # ---- signalling and lifetime ------------------------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_connection_state)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        self.pc.addTrack(self.track)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        loop = asyncio.get_running_loop()
        self._timers = [loop.call_later(self.settings.webrtc_ice_timeout_s, self._on_ice_deadline)]
        description = self.pc.localDescription
        assert description is not None
        return description.sdp

    async def run(self) -> None:
        try:
            await self._write()
        except Exception:
            log.exception("video-chat call writer failed")
            self._end_reason = "internal_error"
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        await self.runner.close()
        self.lease.release()
        self.telemetry.call_ended(self._end_reason, self.track)
        self.track.stop()
        try:
            await self.pc.close()
        finally:
            pending = [*self._inbound, *([self._listener] if self._listener is not None else [])]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _on_connection_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.runner.abort("client_disconnected")
            self.track.wake()

    def _on_ice_deadline(self) -> None:
        if self.pc.connectionState != "connected" and not self.runner.closed:
            self.telemetry.ice_timeouts.inc()
            timeout = self.settings.webrtc_ice_timeout_s
            self.runner.fail("ice_timeout", f"the peer connection did not connect within {timeout:g} s")
            self.track.wake()

    def _on_track(self, track: MediaStreamTrack) -> None:
        coroutine = consume_microphone(track, self._on_microphone) if track.kind == "audio" else self._camera(track)
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._inbound.add(task)
        task.add_done_callback(self._inbound.discard)

    def _on_microphone(self, pcm: bytes) -> None:
        # The VAD costs about 1 ms per 32 ms window: it runs on a worker thread, one batch at a time, and audio that
        # arrives meanwhile waits (bounded) for the next batch.
        if len(self._heard) + len(pcm) <= MAX_UNHEARD_BYTES:
            self._heard += pcm
        if self._listener is None or self._listener.done():
            self._listener = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while self._heard and not self.runner.closed:
            batch, self._heard = bytes(self._heard), bytearray()
            question = await asyncio.to_thread(self.questions.push, batch)
            if question is not None and not self.runner.closed:
                self.runner.query("", question)

    async def _camera(self, track: MediaStreamTrack) -> None:
        loop = asyncio.get_running_loop()
        next_at = 0.0
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            now = loop.time()
            if isinstance(frame, av.VideoFrame) and now >= next_at and not self.runner.closed:
                next_at = now + 1.0 / CAMERA_FPS
                self.runner.frame(frame)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != CHANNEL or self._channel is not None:
            channel.close()
            return
        self._channel = ChannelWriter(channel, self.settings.stall_timeout_s)

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            if isinstance(message, bytes):
                self.runner.error("invalid_message", "binary messages are not accepted on this channel; send JSON")
                return
            handle_client_text(self.runner, message, self.settings)

        @channel.on("close")
        def on_close() -> None:
            self.runner.abort("client_disconnected")
            self.track.wake()

    # ---- writer -----------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        streams: dict[int, RtcOpusStream] = {}
        while True:
            await self.track.wait_for_room()
            event = await self.runner.next_event()
            if isinstance(event, Closed):
                self._end_reason = event.reason
                if self._channel is not None:
                    await self._channel.flush()
                return
            if isinstance(event, ResponseAudioDelta):
                stream = streams.get(event.query)
                if stream is None:
                    stream = streams[event.query] = RtcOpusStream(event.sample_rate, self.settings.webrtc_opus_bitrate)
                self.track.push(event.query, await asyncio.to_thread(stream.encode, event.pcm))
                continue
            if isinstance(event, ResponseAudioDone):
                stream = streams.pop(event.query, None)
                if stream is not None and event.status == "completed":
                    self.track.push(event.query, await asyncio.to_thread(stream.finish))
                self.track.end_utterance()
            if not await self._send(event_json(event, "pcm")):
                return

    async def _send(self, body: dict[str, Any]) -> bool:
        if self._channel is None:
            return True  # nobody to tell yet
        result = await self._channel.send(msgspec.json.encode(body).decode())
        if result != "sent":
            self._end_reason = "stalled" if result == "stalled" else "client_disconnected"
            self.runner.abort(self._end_reason)
            self.track.wake()
        return result == "sent"


async def video_chat_calls_endpoint(request: Request) -> Response:
    """``POST /v1/video/chat/calls``: an SDP offer with camera and microphone in; 503 without an omni model."""
    from omnigate.engines.vad import SpeechProbability

    gateway: Gateway = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    engine: ThinkEngine | None = getattr(request.app.state, "omni_engine", None)
    try:
        offer = await read_offer(request, gateway.settings.webrtc_max_offer_bytes)
        if engine is None:
            raise HttpError(503, UNAVAILABLE, code="video_chat_unavailable")
        if gateway.pool is None:
            raise HttpError(503, "the engine is not loaded yet", code="not_ready")
        lease = admit_call(gateway, TRANSPORT)
    except HttpError as exc:
        return exc.response()
    vad = await asyncio.to_thread(SpeechProbability, RTC_SAMPLE_RATE)
    frames = frame_decoding(request.app)
    call = VideoChatCall("rtc_" + secrets.token_hex(12), gateway, lease, calls.telemetry, engine, frames, vad)
    return await answer_call(call, offer, calls, CALLS_PATH)
