"""The load-test ``realtime-webrtc`` target against the real server (loopback): a duplex engine, and a TTS engine
whose server VAD must hear the speech the microphone track carries."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from omnigate.gateway.settings import Settings
from omnigate.loadtest.report import TargetSpec
from omnigate.loadtest.targets import target_class
from omnigate.loadtest.targets.base import SessionSettings
from omnigate.loadtest.targets.realtime import SPEECH_FILE, load_speech
from omnigate.loadtest.targets.realtime_webrtc import FRAME_SAMPLES, MicrophoneTrack, RealtimeWebRtcTarget
from omnigate.loadtest.targets.webrtc import TRACK_SAMPLE_RATE
from omnigate.loadtest.traces import SessionTrace
from tests.audio_checks import synthetic_ms
from tests.integration.test_webrtc import LOOPBACK
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

SPEECH_S = len(load_speech(SPEECH_FILE, TRACK_SAMPLE_RATE)) / 2 / TRACK_SAMPLE_RATE
BYTES_PER_MS = TRACK_SAMPLE_RATE * 2 // 1000  # mono s16le at the track rate


@pytest.fixture(scope="module")
def rtc_duplex_server() -> Iterator[RunningServer]:
    settings = Settings(
        engine="duplex", model="preset:tiny", engine_options={"max_sessions": "2"}, webrtc_host_addresses=LOOPBACK
    )
    with serve(settings) as server:
        yield server


async def run_one(target: RealtimeWebRtcTarget, texts: list[str]) -> SessionTrace:
    trace = SessionTrace(0, time.perf_counter())
    await target.open()
    try:
        await target.run_session(texts, trace)
    finally:
        await target.close()
    trace.end(time.perf_counter())
    return trace


def test_the_target_is_selectable_and_refuses_what_it_does_not_measure() -> None:
    assert target_class("realtime-webrtc") is RealtimeWebRtcTarget
    with pytest.raises(ValueError, match="barge-in"):
        RealtimeWebRtcTarget(TargetSpec(label="r", target="realtime-webrtc", url="http://h:1#barge_in_ms=300"),
                             SessionSettings())  # fmt: skip


async def test_the_microphone_sends_speech_then_silence_in_20_ms_frames() -> None:
    microphone = MicrophoneTrack()
    speech = bytes(range(256)) * 15  # 3,840 bytes: exactly two frames
    spoken = microphone.say(speech)
    frames = [await microphone.recv() for _ in range(3)]
    assert [f.samples for f in frames] == [FRAME_SAMPLES] * 3
    assert [f.pts for f in frames] == [0, FRAME_SAMPLES, 2 * FRAME_SAMPLES]
    assert {f.sample_rate for f in frames} == {TRACK_SAMPLE_RATE}
    assert b"".join(bytes(f.planes[0])[: FRAME_SAMPLES * 2] for f in frames[:2]) == speech
    assert not any(bytes(frames[2].planes[0])[: FRAME_SAMPLES * 2])
    assert spoken.done()
    microphone.stop()


async def test_a_duplex_reply_is_heard_on_the_track(rtc_duplex_server: RunningServer) -> None:
    spec = TargetSpec(label="r", target="realtime-webrtc", url=rtc_duplex_server.http_url + "#reply_ms=1000")
    trace = await run_one(RealtimeWebRtcTarget(spec, SessionSettings(utterance_timeout_s=60.0)), ["(the model)"] * 2)
    assert trace.status == "completed", trace.error_details
    assert trace.negotiated == {"audio_codec": "opus/48000/2", "format": "audio/pcm 24000 Hz"}
    assert len(trace.utterances) == 2
    for utterance in trace.utterances:
        assert utterance.status == "completed"
        # The user's turn went out on the track in real time before the reply was listened for.
        assert utterance.sends[0][0] - utterance.started_s >= SPEECH_S - 0.02
        assert 1000.0 <= utterance.audio_ms <= 1020.0  # whole 20 ms frames up to reply_ms
        assert utterance.bytes == utterance.audio_ms * BYTES_PER_MS
        ttfa_ms = utterance.ttfa_ms()
        assert ttfa_ms is not None and ttfa_ms >= 0.0


async def test_a_voice_agent_turn_against_a_tts_engine_with_server_vad() -> None:
    text = "Sure, a table for two at eight."
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK)) as server:
        spec = TargetSpec(label="r", target="realtime-webrtc", url=server.http_url)
        trace = await run_one(RealtimeWebRtcTarget(spec, SessionSettings(utterance_timeout_s=30.0)), [text])
    assert trace.status == "completed", trace.error_details
    (utterance,) = trace.utterances
    assert utterance.status == "completed"
    # The server VAD heard the microphone's speech end; the whole reply came on the track, in 20 ms frames.
    assert synthetic_ms(text) - 100 <= utterance.audio_ms <= synthetic_ms(text) + 100
    latency = utterance.ttfa_ms()
    # Voice to voice: the server VAD needs its 500 ms of silence to end the turn before the reply starts.
    assert latency is not None and 300.0 < latency < 5000.0
