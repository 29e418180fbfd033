"""Each target's verdict on an utterance from recorded server event sequences: anything short of ``completed`` fails.

The targets' event handlers are fed the events a server sends (no transport); a non-completed terminal status must
end the utterance as failed with a typed error, so the level fails as it would on an error.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import RATE, RealtimeEvent, RealtimeTarget, _Session, _Turn, output_format
from omnigate.loadtest.targets.webrtc import _Receiving as WebRtcReceiving
from omnigate.loadtest.targets.webrtc import answer_audio_codec
from omnigate.loadtest.targets.ws_speech import WsSpeechTarget
from omnigate.loadtest.targets.ws_speech import _Receiving as WsReceiving
from omnigate.loadtest.traces import SessionTrace


def speech_events(done: dict[str, Any]) -> list[str]:
    """One sentence of the speech stream protocol ending with ``done`` (the ``session.done`` event)."""
    return [
        json.dumps({"type": "audio.start", "sentence_index": 0, "sentence_text": "Hi.", "format": "pcm"}),
        json.dumps({"type": "audio.done", "sentence_index": 0, "total_bytes": 1920}),
        json.dumps({"type": "session.done", "total_sentences": 1, **done}),
    ]


def ws_speech_outcome(done: dict[str, Any]) -> SessionTrace:
    trace = SessionTrace(0, 0.0)
    state = WsReceiving()
    state.utterance = trace.begin_utterance(0.0, "Hi.")
    for index, message in enumerate(speech_events(done)):
        WsSpeechTarget._on_event(message, 0.1 * index, trace, state)
    assert state.done.is_set()
    trace.end(1.0)
    return trace


def test_ws_speech_completed_utterance_and_the_format_answered() -> None:
    trace = ws_speech_outcome({"status": "completed"})
    assert trace.utterances[0].status == "completed"
    assert trace.status == "completed"
    assert trace.negotiated == {"format": "pcm 24000 Hz"}


def test_ws_speech_without_a_status_means_completed() -> None:
    assert ws_speech_outcome({}).utterances[0].status == "completed"


@pytest.mark.parametrize("status", ["max_duration", "error", "cancelled", "silence"])
def test_ws_speech_session_done_short_of_completed_fails_the_utterance(status: str) -> None:
    trace = ws_speech_outcome({"status": status, "error": "why it ended"})
    assert trace.utterances[0].status == "failed"
    assert trace.errors == {f"utterance_{status}": 1}
    assert trace.error_details[f"utterance_{status}"] == "why it ended"
    assert trace.status == "failed"


def test_webrtc_session_done_short_of_completed_fails_at_once() -> None:
    trace = SessionTrace(0, 0.0)
    state = WebRtcReceiving(trace)
    state.begin(trace.begin_utterance(0.0, "Hi."))
    for message in speech_events({"status": "max_duration"}):
        state.on_event(message, 0.2)
    assert state.done.is_set()
    assert trace.utterances[0].status == "failed"
    assert trace.errors == {"utterance_max_duration": 1}


def test_webrtc_completed_session_done_waits_for_the_audio_in_flight() -> None:
    trace = SessionTrace(0, 0.0)
    state = WebRtcReceiving(trace)
    state.begin(trace.begin_utterance(0.0, "Hi."))
    for message in speech_events({"status": "completed"}):
        state.on_event(message, 0.2)
    assert not state.done.is_set()
    assert trace.utterances[0].status == "running"


def test_the_audio_codec_of_an_sdp_answer() -> None:
    answer = "\r\n".join(
        [
            "v=0",
            "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
            "m=audio 9 UDP/TLS/RTP/SAVPF 111 0",
            "a=rtpmap:0 PCMU/8000",
            "a=rtpmap:111 opus/48000/2",
        ]
    )
    assert answer_audio_codec(answer) == "opus/48000/2"
    assert answer_audio_codec("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=rtpmap:96 VP8/90000") == "none"


class FakeConnection:
    """Collects what the target sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, message: str) -> None:
        self.sent.append(json.loads(message))


def delta(response_id: str, ms: int) -> RealtimeEvent:
    audio = base64.b64encode(bytes(RATE * 2 * ms // 1000)).decode()
    return RealtimeEvent(type="response.output_audio.delta", response_id=response_id, delta=audio)


async def realtime_outcome(
    status: str, fragment: str = "", metadata: dict[str, str] | None = None, target: RealtimeTarget | None = None
) -> tuple[SessionTrace, _Turn, FakeConnection]:
    """A voice-agent turn against a TTS engine: response created, 200 ms of audio, then ``response.done``."""
    spec = TargetSpec(label="realtime", target="realtime", url=f"ws://127.0.0.1:1/v1/realtime{fragment}")
    target = target or RealtimeTarget(spec, SessionSettings())
    trace = SessionTrace(0, 0.0)
    state = _Session()
    connection = FakeConnection()
    lock = asyncio.Lock()
    utterance = trace.begin_utterance(0.0, "Hi.")
    utterance.text_sent(0.0, 3)
    turn = _Turn(utterance, speech_end_s=0.0, duplex=False)
    state.turn = turn
    events = [
        RealtimeEvent(
            type="session.created", session={"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}}
        ),
        RealtimeEvent(type="input_audio_buffer.speech_stopped"),
        RealtimeEvent(type="conversation.item.input_audio_transcription.completed"),
        RealtimeEvent(type="response.created", response={"id": "r1"}),
        *(delta("r1", 40) for _ in range(5)),
        RealtimeEvent(
            type="response.done",
            response={"id": "r1", "status": status, "status_details": {"reason": "x"}, "metadata": metadata},
        ),
    ]
    for index, event in enumerate(events):
        await target._on_event(event, 0.1 + 0.01 * index, trace, state, connection, lock)  # type: ignore[arg-type]
    assert turn.done.is_set()
    trace.end(1.0)
    return trace, turn, connection


async def test_realtime_completed_response_completes_and_the_format_is_recorded() -> None:
    trace, _, _ = await realtime_outcome("completed")
    assert trace.utterances[0].status == "completed"
    assert trace.negotiated == {"format": "audio/pcm 24000 Hz"}
    assert trace.status == "completed"


@pytest.mark.parametrize("status", ["incomplete", "failed", "cancelled"])
async def test_realtime_response_done_short_of_completed_fails_the_utterance(status: str) -> None:
    trace, _, connection = await realtime_outcome(status)
    assert connection.sent == [], "the client cancelled nothing"
    assert trace.utterances[0].status == "failed"
    assert trace.errors == {f"response_{status}": 1}


async def test_realtime_a_response_the_client_cancelled_is_a_completed_barge_in() -> None:
    trace, turn, connection = await realtime_outcome("cancelled", "#barge_in_ms=100")
    assert connection.sent == [{"type": "response.cancel"}]
    assert turn.cancelled
    assert trace.utterances[0].status == "completed"
    assert trace.errors == {}


async def test_realtime_talk_mode_collects_the_turn_timings_the_server_reports() -> None:
    spec = TargetSpec(label="realtime", target="realtime", url="ws://127.0.0.1:1/v1/realtime#talk=1")
    target = RealtimeTarget(spec, SessionSettings())
    metadata = {
        "omnigate_asr_ms": "150.2",
        "omnigate_first_token_ms": "60.0",
        "omnigate_overhead_ms": "12.0",
        "omnigate_note": "x",
        "other_ms": "1",
    }
    trace, _, _ = await realtime_outcome("completed", metadata=metadata, target=target)
    await realtime_outcome("failed", metadata=metadata, target=target)  # a failed response reports no turn
    [timings] = target.turn_timings
    assert {k: v for k, v in timings.items() if not k.startswith("client_")} == {
        "asr": 150.2,
        "first_token": 60.0,
        "overhead": 12.0,
    }
    # speech sent at 0 s, speech_stopped at 0.11 s, the transcript at 0.12 s, the first reply audio at 0.14 s
    assert timings["client_voice_to_voice"] == pytest.approx(140.0)
    assert timings["client_turn_to_audio"] == pytest.approx(30.0)
    # The turn's split, for the level's report: the client's own steps and the server's first token.
    steps = trace.utterances[0].steps
    assert steps == pytest.approx(
        {
            "voice_to_voice": 140.0,
            "end_of_turn": 110.0,
            "transcription": 10.0,
            "first_token": 60.0,
            "turn_to_audio": 30.0,
        }
    )


def test_realtime_output_format_when_unannounced() -> None:
    assert output_format({}) == "unannounced"
    assert output_format({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}) == "audio/pcmu"
