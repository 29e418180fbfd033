"""One WebRTC call: a peer connection bound to one speech session or one realtime session.

The data channel ``oai-events`` (OpenAI's WebRTC flow) carries the realtime protocol instead, served by
:mod:`omnigate.gateway.webrtc.realtime_channel`; a call uses one of the two channels, and the first opened wins.
The data channel ``speech`` carries the speech-stream protocol (the same messages and mapping as the WebSocket
route, from :mod:`omnigate.gateway.speech.adapter`); audio goes out on the media track as 20 ms Opus packets. The
writer task takes the session's events in order: control events go to the data channel, media is encoded in a
worker thread and queued on the track a few packets ahead of its clock. The writer only takes the next event when
the track has room, so generated audio waits in the session outbox, whose room is the engine's credit: the engine
never runs more than the outbox (0.5 s by default) ahead of what the listener hears.

The call ends when the session ends (close, fatal error, timeouts), when the peer goes away (connection failed or
closed, data channel closed), when ICE does not connect in time, or when the server stops; the peer connection is
closed in every case.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnigate.codecs.rtc_audio import RTC_FRAME_MS, RTC_SAMPLE_RATE, RtcOpusStream
from omnigate.gateway.errors import json_error
from omnigate.gateway.realtime.backend import SessionRefused
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.realtime.service import RealtimeService
from omnigate.gateway.realtime.ws import session_voice
from omnigate.gateway.security.client_session import stored_session_event
from omnigate.gateway.speech.adapter import (
    INTERNAL_ERROR,
    SpeechInput,
    audio_done_event,
    audio_start_event,
    error_event,
    fail_session,
    session_done_event,
)
from omnigate.gateway.speech.protocol import InputCancel
from omnigate.gateway.state import Gateway
from omnigate.gateway.webrtc.channel import CHANNEL_LOW_WATER_BYTES, ChannelWriter
from omnigate.gateway.webrtc.ice import rtc_configuration
from omnigate.gateway.webrtc.microphone import MicrophoneRing, consume_microphone
from omnigate.gateway.webrtc.realtime_channel import RealtimeChannel, track_limits
from omnigate.gateway.webrtc.telemetry import WebRtcTelemetry
from omnigate.gateway.webrtc.track import DEFAULT_LEAD_FRAMES, SpeechTrack
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import (
    ErrorEvent,
    MediaChunk,
    SegmentDone,
    SegmentStarted,
    SessionClosed,
    UtteranceDone,
)
from omnigate.sessions.realtime.server_events import ErrorEvent as RealtimeError
from omnigate.sessions.realtime.server_events import WireError, encode_event
from omnigate.sessions.registry import SessionLease

log = logging.getLogger(__name__)

TRANSPORT = "webrtc"
SPEECH_CHANNEL = "speech"
REALTIME_CHANNEL = "oai-events"


class WebRtcCall:
    """A peer connection, its session, and the tasks between them. Create it, :meth:`answer`, :meth:`run`.

    ``realtime`` serves the ``oai-events`` channel (None: the server runs no realtime engine); ``model`` is the
    realtime model the call asked for (the ``model`` query parameter of the offer).
    """

    def __init__(
        self,
        call_id: str,
        gateway: Gateway,
        lease: SessionLease,
        telemetry: WebRtcTelemetry,
        realtime: RealtimeService | None = None,
        model: str | None = None,
        minted: dict[str, Any] | None = None,
    ) -> None:
        assert gateway.pool is not None
        self.call_id = call_id
        self.minted = minted  # the session minted with the call's client secret, applied to the channel's session
        self.settings = gateway.settings
        self.realtime_service = realtime
        self.model = model
        self.realtime: RealtimeChannel | None = None
        self._admitting = False  # a realtime channel waits for the engine to take its session
        self.lease = lease
        self.telemetry = telemetry
        # The track's lead counts toward the bound on generated audio not yet heard.
        lead_ms = DEFAULT_LEAD_FRAMES * RTC_FRAME_MS
        outbox_ms = max(lead_ms, self.settings.webrtc_outbox_ms - lead_ms)
        self._outbox_ms = outbox_ms
        self.driver = SessionDriver(
            gateway.pool, gateway.limits(outbox_ms), on_first_audio=telemetry.observe_first_audio
        )
        lease.driver = self.driver
        self.input = SpeechInput(self.driver, gateway)
        self.track = SpeechTrack(self._track_epoch, DEFAULT_LEAD_FRAMES)
        self.microphone = MicrophoneRing(self.settings.webrtc_microphone_bytes)
        self.pc = RTCPeerConnection(rtc_configuration(self.settings.webrtc_stun_servers))
        self._channel: ChannelWriter | None = None
        self._inbound: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._created = asyncio.get_running_loop().time()
        self._end_reason = "client_disconnected"
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
        loop = asyncio.get_running_loop()
        self._timers = [
            loop.call_later(self.settings.webrtc_ice_timeout_s, self._on_ice_deadline),
            loop.call_later(self.settings.config_timeout_s, self._on_config_deadline),
        ]
        description = self.pc.localDescription
        assert description is not None
        return description.sdp

    # ---- lifetime ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session until it ends, then close everything. Never raises (cancellation aside)."""
        try:
            await self._write()
            if self.realtime is not None:
                await self.realtime.run()
                self._end_reason = self.realtime.end_reason
        except Exception:
            log.exception("webrtc call writer failed")
            self._end_reason = INTERNAL_ERROR
            if self.realtime is None:
                await self._end_failed()
        finally:
            await self.close()

    async def _end_failed(self) -> None:
        """The writer died: the client gets a typed error and its utterances' ends on the channel, if it can."""
        try:
            for body in fail_session(self.driver, "the server failed while serving this call; retry"):
                if not await self._send(body):
                    return
            if self._channel is not None:
                await self._channel.flush()
        except Exception:  # the channel itself is what failed: the call closes all the same
            log.exception("could not tell a webrtc call why it ended")

    def stop(self, reason: str) -> None:
        """End the session from outside (server shutdown); :meth:`run` then closes the call."""
        self._abort(reason, reason)

    def _abort(self, reason: str, code: str | None = None) -> None:
        if self.realtime is not None:
            self.realtime.end(reason, code)
            return
        self.driver.abort(reason, code)
        # A writer waiting for room on a track that is not playing (not connected yet) must see the end too.
        self.track.wake()

    def _fail(self, code: str, message: str) -> None:
        if self.realtime is not None:
            self.realtime.end(code, code, message)
            return
        self.driver.fail(code, message)
        self.track.wake()

    async def close(self) -> None:
        """Close the peer connection and free the session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        self.driver.release()
        if self.realtime is not None:
            self.realtime.connection.release()
        self.lease.release()
        self.telemetry.call_ended(self._end_reason, self.track)
        self.track.stop()
        try:
            await self.pc.close()
        finally:
            for task in self._inbound:
                task.cancel()
            await asyncio.gather(*self._inbound, return_exceptions=True)

    # ---- peer connection events -------------------------------------------------------------------------------

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.telemetry.connect_seconds.observe(asyncio.get_running_loop().time() - self._created)
        elif state in ("failed", "closed"):
            self._abort("client_disconnected")

    def _on_ice_deadline(self) -> None:
        if self.pc.connectionState != "connected":
            if not (self.realtime.closed if self.realtime is not None else self.driver.closed):
                self.telemetry.ice_timeouts.inc()
            timeout = self.settings.webrtc_ice_timeout_s
            self._fail("ice_timeout", f"the peer connection did not connect within {timeout:g} s")

    def _on_config_deadline(self) -> None:
        if self.realtime is None and self.driver.session.config is None:
            self._fail("config_timeout", "no session.config within the config timeout")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._spawn(consume_microphone(track, self._on_microphone))
        else:
            self._spawn(_discard(track))

    def _spawn(self, coroutine: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._inbound.add(task)
        task.add_done_callback(self._inbound_done)

    def _inbound_done(self, task: asyncio.Task[None]) -> None:
        self._inbound.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # A task of this call died: the call ends typed rather than going on without it.
        log.error("a webrtc call task failed", exc_info=task.exception())
        self._fail(INTERNAL_ERROR, "the server failed while serving this call; retry")

    def _on_microphone(self, pcm: bytes) -> None:
        if self.realtime is not None:
            self.realtime.receive_microphone(pcm)
        else:
            self.microphone.append(pcm)

    def _track_epoch(self) -> int:
        return self.realtime.epoch if self.realtime is not None else self.driver.session.epoch

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        in_use = self._channel is not None or self.realtime is not None or self._admitting
        if channel.label == SPEECH_CHANNEL and not in_use:
            self._bind_speech_channel(channel)
        elif channel.label == REALTIME_CHANNEL and not in_use:
            self._bind_realtime_channel(channel)
        elif channel.label == SPEECH_CHANNEL:
            _refuse_channel(channel, json_error("channel_in_use", _IN_USE_MESSAGE))
        elif channel.label == REALTIME_CHANNEL:
            _refuse_channel(channel, _realtime_refusal("channel_in_use", _IN_USE_MESSAGE))
        else:
            channel.close()

    def _bind_realtime_channel(self, channel: RTCDataChannel) -> None:
        """Serve the realtime protocol on ``channel``: the call's speech session ends unused, a realtime one starts."""
        service = self.realtime_service
        if service is None or self.driver.closed:
            _refuse_channel(channel, _realtime_refusal("not_ready", "the realtime engines are not available"))
            return
        try:
            route = service.route(duplex=None, model=self.model)
        except SessionRefused as exc:
            _refuse_channel(channel, _realtime_refusal(exc.code, exc.message))
            return
        duplex = route.backend.capabilities.native_duplex
        connection = RealtimeConnection(
            route.backend,
            limits=track_limits(service.limits, self._outbox_ms),
            model=route.model,
            served_models=route.served_models,
            resolve_voice=lambda name: session_voice(service, duplex, name),
            vad_executor=service.vad_executor,
            audio_route="track",
            responder=service.responder,
            reports=service.reports,
        )
        if not route.backend.admits_async:
            self._open_realtime(channel, connection, EarlyMessages())
            return
        # The engine answers first (an engine core's slots are shared by every gateway worker); the channel's
        # messages wait for the session to be announced.
        early = EarlyMessages()
        self._admitting = True
        channel.on("message", early.hold)
        self._spawn(self._admit_realtime(channel, connection, early))

    async def _admit_realtime(
        self,
        channel: RTCDataChannel,
        connection: RealtimeConnection,
        early: EarlyMessages,
    ) -> None:
        try:
            await connection.reserve()
        except SessionRefused as exc:
            connection.release()
            _refuse_channel(channel, _realtime_refusal(exc.code, exc.message))
            return
        except BaseException:  # the call closed meanwhile
            connection.release()
            raise
        finally:
            self._admitting = False
            channel.remove_listener("message", early.hold)
        if self._closed or self.driver.closed:
            connection.release()
            return
        self._open_realtime(channel, connection, early)

    def _open_realtime(self, channel: RTCDataChannel, connection: RealtimeConnection, early: EarlyMessages) -> None:
        try:
            connection.open()
        except SessionRefused as exc:
            connection.release()
            _refuse_channel(channel, _realtime_refusal(exc.code, exc.message))
            return
        minted = stored_session_event(self.minted, "realtime")
        if minted is not None:
            connection.receive_text(minted)
        self.realtime = RealtimeChannel(
            channel,
            connection,
            self.track,
            opus_bitrate=self.settings.webrtc_opus_bitrate,
            stall_timeout_s=self.settings.stall_timeout_s,
        )
        for message in early.messages:
            self.realtime.receive_message(message)
        if early.dropped:
            connection.protocol_error(
                "too_many_messages",
                f"{early.dropped} messages sent before the session was created were dropped (at most "
                f"{MAX_EARLY_MESSAGES} are kept)",
            )
        self.lease.driver = None
        self.lease.drain_target = connection  # a drain closes idle sessions at once, responding ones when done
        # The speech session never configured ends here; its writer returns and run() serves the realtime one.
        self.driver.abort("realtime")

    def _bind_speech_channel(self, channel: RTCDataChannel) -> None:
        self._channel = ChannelWriter(channel, self.settings.stall_timeout_s)
        minted = stored_session_event(self.minted, "speech")
        if minted is not None:
            self.input.on_text(minted)

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            if isinstance(message, bytes):
                self.input.error("invalid_message", "binary messages are not accepted on this channel; send JSON text")
                return
            if isinstance(self.input.on_text(message), InputCancel):
                self.telemetry.cancels.inc()

        @channel.on("close")
        def on_close() -> None:
            self._abort("client_disconnected")

    # ---- writer -----------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        stream: RtcOpusStream | None = None
        stream_utterance = -1
        segment_bytes = 0
        fatal_sent = False
        while True:
            await self.track.wait_for_room()
            event = await self.driver.next_event()
            if isinstance(event, MediaChunk):
                if event.epoch < self.driver.session.epoch:
                    continue
                if stream is None or stream_utterance != event.utterance:
                    stream = RtcOpusStream(event.sample_rate, self.settings.webrtc_opus_bitrate)
                    stream_utterance = event.utterance
                before = stream.bytes_out
                packets = await asyncio.to_thread(stream.encode, event.pcm)
                segment_bytes += stream.bytes_out - before
                self.track.push(event.epoch, packets)
            elif isinstance(event, SegmentStarted):
                segment_bytes = 0
                if not await self._send(audio_start_event(event, "opus", RTC_SAMPLE_RATE)):
                    return
            elif isinstance(event, SegmentDone):
                if not await self._send(audio_done_event(event, segment_bytes)):
                    return
            elif isinstance(event, UtteranceDone):
                if stream is not None and stream_utterance == event.utterance:
                    if event.status != "cancelled" and event.epoch >= self.driver.session.epoch:
                        self.track.push(event.epoch, await asyncio.to_thread(stream.finish))
                    stream = None
                self.track.end_utterance()
                if not await self._send(session_done_event(event)):
                    return
            elif isinstance(event, ErrorEvent):
                fatal_sent = event.fatal
                if not await self._send(error_event(event)):
                    return
            elif isinstance(event, SessionClosed):
                self._end_reason = event.reason
                if event.code is not None and not fatal_sent:
                    # Where a WebSocket would carry the reason in its close code (shutting down, stalled).
                    await self._send(json_error(event.code, f"the session ended: {event.reason}"))
                if self._channel is not None:
                    await self._channel.flush()
                return

    async def _send(self, body: dict[str, Any]) -> bool:
        """Send one event on the speech channel; False when the peer is gone or stopped reading."""
        if self._channel is None:
            return True  # nothing was asked yet, so there is nobody to tell
        result = await self._channel.send(msgspec.json.encode(body).decode())
        if result == "closed":
            self._abort("client_disconnected")
        elif result == "stalled":
            log.info("closing a WebRTC call whose data channel is stalled")
            self._end_reason = "stalled"
            self._abort("stalled", "stalled")
        return result == "sent"


MAX_EARLY_MESSAGES = 64  # a realtime channel's messages kept while the engine takes its session


class EarlyMessages:
    """A realtime channel's messages that arrive while the engine takes its session, in order, bounded."""

    def __init__(self) -> None:
        self.messages: list[str | bytes] = []
        self.dropped = 0

    def hold(self, message: str | bytes) -> None:
        if len(self.messages) < MAX_EARLY_MESSAGES:
            self.messages.append(message)
        else:
            self.dropped += 1


_IN_USE_MESSAGE = "a call carries one protocol: the 'speech' or the 'oai-events' data channel, not both"


def _realtime_refusal(code: str, message: str) -> dict[str, Any]:
    error = RealtimeError(
        event_id="event_refused", error=WireError(type="invalid_request_error", code=code, message=message)
    )
    body: dict[str, Any] = msgspec.json.decode(encode_event(error))
    return body


def _refuse_channel(channel: RTCDataChannel, body: dict[str, Any]) -> None:
    """Answer every message of a channel this call does not serve with the same typed error."""

    def refuse() -> None:
        if channel.readyState == "open" and channel.bufferedAmount < CHANNEL_LOW_WATER_BYTES:
            channel.send(msgspec.json.encode(body).decode())

    channel.on("message", lambda _message: refuse())
    refuse()


async def _discard(track: MediaStreamTrack) -> None:
    """Read a track nobody uses, so aiortc's queue for it stays empty."""
    while True:
        try:
            await track.recv()
        except MediaStreamError:
            return
