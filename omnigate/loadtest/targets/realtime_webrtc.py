"""``realtime-webrtc``: voice sessions over WebRTC, as a browser runs OpenAI's Realtime WebRTC flow.

Each session is one call to ``POST /v1/realtime/calls``: the microphone is a send-receive audio track that carries
audio in real time (20 ms frames on a wall-clock schedule: silence between turns, and per utterance the recorded
user turn of the ``realtime`` target), the ``oai-events`` data channel carries the realtime protocol, and the replies
come back on the remote audio track. A turn goes as on the ``realtime`` target:

- against a text-to-speech engine the client waits for the server's ``speech_stopped`` (server VAD), creates an
  assistant item with the utterance's text and asks for a response;
- against a natively duplex engine the model answers on its own: the reply is the model audio heard after the end of
  the user's speech, until its response ends or ``reply_ms`` of it has been heard.

Reply audio is counted as on the ``webrtc`` target: decoded 20 ms frames that are not digital silence (the server's
track sends silence while no response plays), each arriving when it was decoded; a response's audio ends at the
first silent frame after its ``response.done``. TTFA is the voice-to-voice latency: from the microphone frame that
carried the last of the user's speech to the first audible reply frame. Underruns come from replaying the reply's
arrivals through the jitter-buffer player, as for every target.

Client options go in the URL fragment as on the ``realtime`` target (``append_ms`` does not apply: the track's
frames are 20 ms; ``barge_in_ms`` is not measured here): ``http://host:8000#reply_ms=3000&speech=turn.wav``.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import av
import msgspec
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import (
    EVENT_DECODER,
    SPEECH_FILE,
    RealtimeEvent,
    load_speech,
    output_format,
    split_options,
)
from omnigate.loadtest.targets.webrtc import (
    TRACK_SAMPLE_RATE,
    SpeechPeer,
    WebRtcTarget,
    is_silent,
    wait_unless_ended,
)
from omnigate.loadtest.traces import SessionTrace, UtteranceTrace

REALTIME_CHANNEL = "oai-events"
FRAME_SAMPLES = TRACK_SAMPLE_RATE // 50  # 20 ms, the WebRTC audio packet time
_FRAME_BYTES = FRAME_SAMPLES * 2
_SPEECH_STOP_WAIT_S = 5.0


class MicrophoneTrack(MediaStreamTrack):
    """A microphone on a wall clock: 20 ms mono frames at 48 kHz, queued speech first, silence otherwise."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._speech = bytearray()
        self._spoken: asyncio.Future[float] | None = None
        self._start_s: float | None = None
        self._index = 0

    def say(self, pcm: bytes) -> asyncio.Future[float]:
        """Queue ``pcm`` (mono s16le at 48 kHz); the future resolves to when its last frame left the track."""
        self._speech.extend(pcm)
        self._spoken = asyncio.get_running_loop().create_future()
        return self._spoken

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start_s is None:
            self._start_s = time.perf_counter()
        else:
            # A fixed schedule from the start, so a late frame does not stretch the clock.
            await asyncio.sleep(max(0.0, self._start_s + self._index * 0.02 - time.perf_counter()))
        piece = bytes(self._speech[:_FRAME_BYTES])
        del self._speech[:_FRAME_BYTES]
        frame = av.AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(piece.ljust(_FRAME_BYTES, b"\0"))
        frame.sample_rate = TRACK_SAMPLE_RATE
        frame.pts = self._index * FRAME_SAMPLES
        frame.time_base = fractions.Fraction(1, TRACK_SAMPLE_RATE)
        self._index += 1
        if piece and not self._speech and self._spoken is not None and not self._spoken.done():
            self._spoken.set_result(time.perf_counter())
        return frame


@dataclass(eq=False)
class _Turn:
    """The reply being listened for."""

    utterance: UtteranceTrace
    speech_end_s: float
    duplex: bool
    response_id: str | None = None
    reply_ms: float = 0.0
    server_done: bool = False
    last_audio_s: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self, now_s: float, status: str) -> None:
        self.utterance.finish(now_s, "completed" if status == "completed" else "failed")
        self.done.set()


class _Call:
    """One call's view of the server: the session's capabilities, the response playing, the turn in flight."""

    def __init__(self, trace: SessionTrace, reply_ms: float) -> None:
        self.trace = trace
        self.reply_ms = reply_ms
        self.duplex = False
        self.created = asyncio.Event()
        self.speech_stopped = asyncio.Event()
        self.playing: str | None = None  # the response whose audio the track carries (output_audio_buffer.*)
        self.turn: _Turn | None = None

    def on_event(self, message: str, now_s: float) -> None:
        try:
            event = EVENT_DECODER.decode(message)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.trace.error("protocol_unknown_event", f"{exc}: {message[:200]}")
            return
        kind = event.type
        turn = self.turn
        if kind == "session.created":
            session = event.session or {}
            self.duplex = bool((session.get("capabilities") or {}).get("native_duplex"))
            self.trace.record_negotiated("format", output_format(session))
            self.created.set()
        elif kind == "input_audio_buffer.speech_stopped":
            self.speech_stopped.set()
        elif kind == "error":
            error = event.error or {}
            self.trace.error(str(error.get("code") or "server_error"), str(error.get("message") or ""))
        elif kind == "output_audio_buffer.started":
            self.playing = _response_id(message)
        elif kind == "output_audio_buffer.stopped" and _response_id(message) == self.playing:
            self.playing = None
        elif kind == "response.created" and turn is not None and not turn.duplex and turn.response_id is None:
            turn.response_id = (event.response or {}).get("id")
        elif kind == "response.done" and turn is not None and not turn.done.is_set():
            self._response_done(turn, event, now_s)

    def _response_done(self, turn: _Turn, event: RealtimeEvent, now_s: float) -> None:
        response = event.response or {}
        if turn.response_id is None or response.get("id") != turn.response_id:
            return
        status = str(response.get("status"))
        if status != "completed":
            # Any end short of completed was heard by the user as a cut-off reply.
            self.trace.error(f"response_{status}", str(response.get("status_details")))
            turn.finish(now_s, status)
        elif turn.last_audio_s is None and not turn.duplex:
            turn.finish(now_s, status)  # a reply with no audio: nothing more is coming on the track
        else:
            turn.server_done = True  # the audio still in flight on the track belongs to it

    def on_audio(self, frame: av.AudioFrame, now_s: float) -> None:
        turn = self.turn
        if turn is None or turn.done.is_set() or now_s < turn.speech_end_s:
            return
        if is_silent(frame):
            if turn.server_done:
                turn.finish(turn.last_audio_s if turn.last_audio_s is not None else now_s, "completed")
            return
        if turn.duplex and turn.response_id is None:
            turn.response_id = self.playing
        # Bytes of the same audio as mono s16le at the track rate.
        turn.utterance.audio(now_s, frame.samples * 2 * TRACK_SAMPLE_RATE // frame.sample_rate)
        turn.reply_ms += frame.samples * 1000.0 / frame.sample_rate
        turn.last_audio_s = now_s
        if turn.duplex and turn.reply_ms >= self.reply_ms:
            turn.finish(now_s, "completed")


def _response_id(message: str) -> str | None:
    value = msgspec.json.decode(message, type=dict[str, Any]).get("response_id")
    return value if isinstance(value, str) else None


class RealtimeWebRtcTarget(WebRtcTarget):
    kind = "realtime-webrtc"

    def __init__(self, spec: TargetSpec, settings: SessionSettings) -> None:
        super().__init__(spec, settings)
        _, self.options = split_options(spec.url)
        if self.options.barge_in_ms is not None:
            raise ValueError("the realtime-webrtc target does not measure barge-in; use the realtime target")
        speech = Path(self.options.speech) if self.options.speech else SPEECH_FILE
        self.speech = load_speech(speech, TRACK_SAMPLE_RATE)

    @property
    def calls_url(self) -> str:
        url = super().calls_url
        return url if self.spec.model is None else f"{url}?{urlencode({'model': self.spec.model})}"

    async def run_session(self, texts: Sequence[str], trace: SessionTrace) -> None:
        call = _Call(trace, self.options.reply_ms)
        microphone = MicrophoneTrack()
        peer = SpeechPeer(call.on_event, call.on_audio, microphone, REALTIME_CHANNEL)
        try:
            if await self.connect(peer, trace):
                await self._talk(peer, microphone, texts, call)
        finally:
            microphone.stop()
            await peer.close()

    async def _talk(self, peer: SpeechPeer, microphone: MicrophoneTrack, texts: Sequence[str], call: _Call) -> None:
        trace = call.trace
        timeout_s = self.settings.utterance_timeout_s
        if not await wait_unless_ended(call.created, peer, self.settings.connect_timeout_s):
            trace.error("no_session_created" if not peer.ended.is_set() else "closed_by_server")
            return
        if not call.duplex:
            # The agent composes the replies: the server's VAD only ends the user's turns.
            turn_detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
            update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": turn_detection}}}}
            peer.send_json(update)
        for text in texts:
            if not trace.may_begin_utterance(time.perf_counter()):
                break
            utterance = trace.begin_utterance(time.perf_counter(), text)
            utterance.unit_started(text, TRACK_SAMPLE_RATE)
            call.speech_stopped.clear()
            speech_end_s = await microphone.say(self.speech)
            utterance.text_sent(speech_end_s, len(text))
            turn = _Turn(utterance, speech_end_s, call.duplex)
            call.turn = turn
            if not call.duplex:
                if not await wait_unless_ended(call.speech_stopped, peer, _SPEECH_STOP_WAIT_S):
                    trace.error("no_speech_stopped")
                item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
                if not _send(peer, {"type": "conversation.item.create", "item": item}):
                    trace.error("closed_by_server")
                    return
                _send(peer, {"type": "response.create"})
            if not await wait_unless_ended(turn.done, peer, timeout_s):
                trace.error("utterance_timeout" if not peer.ended.is_set() else "closed_by_server")
                return
        call.turn = None


def _send(peer: SpeechPeer, event: dict[str, Any]) -> bool:
    """Send one event on the data channel; False when the channel is no longer open."""
    if peer.channel.readyState != "open":
        return False
    peer.send_json(event)
    return True
