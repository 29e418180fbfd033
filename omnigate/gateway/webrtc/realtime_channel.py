"""The OpenAI Realtime protocol on a call's ``oai-events`` data channel, with audio on the media tracks.

Each data-channel message goes to the :class:`RealtimeConnection`; microphone audio (48 kHz mono from the inbound
track) is resampled to 24 kHz for it. The writer takes the connection's outputs in order: events go to the data
channel, response audio is Opus-encoded in a worker thread and queued on the outbound track. As on the ``speech``
channel, the writer takes the next output only when the track has room, so audio waits in the connection's bounded
outbox and the engine never runs further ahead than that.

Playback state is known here only, so this adapter emits ``output_audio_buffer.started`` when a response's first
audio is queued and ``output_audio_buffer.stopped`` when its last packet has left the track (or was dropped). A
cancelled response or a cleared buffer moves the track to a new epoch: its queued packets are never sent.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiortc import RTCDataChannel

from omnigate.codecs.resample import StreamResampler
from omnigate.codecs.rtc_audio import RTC_SAMPLE_RATE, RtcOpusStream
from omnigate.gateway.realtime.connection import RealtimeConnection
from omnigate.gateway.webrtc.channel import ChannelWriter
from omnigate.gateway.webrtc.track import SpeechTrack
from omnigate.sessions.realtime.audio import ENGINE_RATE
from omnigate.sessions.realtime.conversation import IdSource
from omnigate.sessions.realtime.outbox import Closing, OutgoingAudio, OutgoingEvent
from omnigate.sessions.realtime.server_events import ServerEvent, encode_event
from omnigate.sessions.realtime.session import RealtimeLimits

log = logging.getLogger(__name__)


class OutputAudioStarted(ServerEvent, frozen=True, tag="output_audio_buffer.started"):
    response_id: str


class OutputAudioStopped(ServerEvent, frozen=True, tag="output_audio_buffer.stopped"):
    response_id: str


class _ResponseHead(msgspec.Struct):
    id: str
    status: str


class _EventHead(msgspec.Struct):
    """The fields of a server event that change what the track plays."""

    type: str
    response: _ResponseHead | None = None


_HEAD_DECODER = msgspec.json.Decoder(_EventHead)


def track_limits(limits: RealtimeLimits, outbox_ms: float) -> RealtimeLimits:
    """A session's limits with the outbox bound of a media track (the track's lead is counted separately)."""
    return msgspec.structs.replace(limits, outbox_media_ms=outbox_ms)


class RealtimeChannel:
    """One ``oai-events`` data channel and the call's tracks, around one :class:`RealtimeConnection`."""

    def __init__(
        self,
        channel: RTCDataChannel,
        connection: RealtimeConnection,
        track: SpeechTrack,
        *,
        opus_bitrate: int,
        stall_timeout_s: float,
    ) -> None:
        self.channel = channel
        self.connection = connection
        self.track = track
        self.opus_bitrate = opus_bitrate
        self._writer = ChannelWriter(channel, stall_timeout_s)
        # Bumped when queued audio must not be heard (cancel, clear); the track drops packets of older epochs.
        self.epoch = 0
        self.end_reason = "client_disconnected"
        self._ids = IdSource()
        self._microphone = StreamResampler(RTC_SAMPLE_RATE, ENGINE_RATE)
        self._stream: RtcOpusStream | None = None
        self._playing: str | None = None  # the response whose audio is on the track
        self._gone = asyncio.Event()
        channel.on("message", self.receive_message)
        channel.on("close", lambda: self.end("client_disconnected"))

    @property
    def closed(self) -> bool:
        return self.connection.closed

    def receive_microphone(self, pcm: bytes) -> None:
        """Inbound track audio, mono s16le at 48 kHz."""
        converted = self._microphone.process(pcm)
        if converted:
            self.connection.receive_audio(converted)

    def end(self, reason: str, code: str | None = None, message: str | None = None) -> None:
        """End the session from outside: the peer went away (no code) or the server ends it (a typed error)."""
        if code is None:
            self.end_reason = reason
            self.connection.disconnect()
            self._gone.set()
        else:
            self.connection.fail(code, message or f"the session ended: {reason}")
        # A writer waiting for room on a track that is not playing (not connected yet) must see the end too.
        self.track.wake()

    async def run(self) -> None:
        """Serve the session until it closes or the peer goes away; the caller then releases the connection."""
        writer = asyncio.create_task(self._write(), name="webrtc-realtime-writer")
        gone = asyncio.create_task(self._gone.wait())
        try:
            await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, gone):
                task.cancel()
            await asyncio.gather(writer, gone, return_exceptions=True)
            # The call and its channel refer to each other: drop the encoder now, not at the cycle's collection.
            self._stream = None
        if not writer.cancelled():
            writer.result()  # the writer's own failure, if any

    def receive_message(self, message: str | bytes) -> None:
        """One data-channel message."""
        if isinstance(message, bytes):
            self.connection.protocol_error("invalid_message", "binary messages are not accepted; send JSON text")
        else:
            self.connection.receive_text(message)

    # ---- writer -----------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        while True:
            await self.track.wait_for_room()
            output = await self.connection.next_output()
            if isinstance(output, OutgoingAudio):
                await self._play(output)
            elif isinstance(output, OutgoingEvent):
                await self._before_event(output.payload)
                if not await self._send(output.payload):
                    return
            elif isinstance(output, Closing):
                self.end_reason = output.reason
                await self._writer.flush()
                return

    async def _play(self, audio: OutgoingAudio) -> None:
        if audio.response_id != self._playing or self._stream is None:
            self._stream = RtcOpusStream(audio.sample_rate, self.opus_bitrate)
            if self._playing is not None:
                self._stopped(self._playing)
            self._playing = audio.response_id
            self._send_now(OutputAudioStarted(event_id=self._ids("event"), response_id=audio.response_id))
        packets = await asyncio.to_thread(self._stream.encode, audio.pcm)
        self.track.push(self.epoch, packets)

    async def _before_event(self, payload: bytes) -> None:
        """Apply what an event means for playback before it is sent: the end of a response, a cleared buffer."""
        if b'"output_audio_buffer.cleared"' in payload:
            if _HEAD_DECODER.decode(payload).type == "output_audio_buffer.cleared":
                self._drop_queued()
            return
        if b'"response.done"' not in payload:
            return
        head = _HEAD_DECODER.decode(payload)
        if head.type != "response.done" or head.response is None or head.response.id != self._playing:
            return
        if head.response.status == "cancelled":
            self._drop_queued()
            return
        stream, self._stream = self._stream, None
        if stream is not None:
            self.track.push(self.epoch, await asyncio.to_thread(stream.finish))
        self.track.end_utterance()
        response_id = self._playing
        self._playing = None
        self.track.on_played(lambda: self._stopped(response_id))

    def _drop_queued(self) -> None:
        self.epoch += 1
        self._stream = None
        self.track.end_utterance()
        if self._playing is not None:
            response_id = self._playing
            self._playing = None
            self.track.on_played(lambda: self._stopped(response_id))

    def _stopped(self, response_id: str) -> None:
        self._send_now(OutputAudioStopped(event_id=self._ids("event"), response_id=response_id))

    def _send_now(self, event: ServerEvent) -> None:
        """Send a small playback event at once (outside the writer's order: it reports what the track did)."""
        if self.channel.readyState == "open" and not self.connection.closed:
            self.channel.send(encode_event(event).decode())

    async def _send(self, payload: bytes) -> bool:
        """Send one event; False when the peer is gone or stopped reading."""
        result = await self._writer.send(payload.decode())
        if result == "closed":
            self.end("client_disconnected")
        elif result == "stalled":
            log.info("closing a WebRTC realtime call whose data channel is stalled")
            self.end("stalled")
        return result == "sent"
