"""``WS /v1/video/chat/stream`` on ``serve --engine qwen3-omni`` (``preset:tiny`` on the CPU): camera frames and the
microphone into Qwen3-Omni's thinker, the answer in text and in the model's own voice, no second speech engine; the
session's vision-token cache; frames and audio past their bounds refused typed; a WebRTC call answered on its data
channel and its audio track; the load test's ``video-chat`` target against it.

Order is asserted from the events' own sequence, never from elapsed time.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from websockets.asyncio.client import connect

from omnigate.engines.qwen3_omni.video_chat import Qwen3VideoChat
from omnigate.gateway.settings import Settings
from omnigate.loadtest.targets.webrtc import use_loopback_candidates
from tests.integration.test_video_chat_ws import ROUTE, gated_decoding, jpeg, receive, send, until_terminal
from tests.integration.test_webrtc_video_chat import CALLS, Peer
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration
__all__ = ["gated_decoding"]  # a fixture of the tests below

VOICE_RATE = 24_000
FRAME_BYTES = 2 * 1920  # one codec frame of the voice: 80 ms of 24 kHz s16le


@pytest.fixture(scope="module")
def qwen3_server() -> Iterator[RunningServer]:
    settings = Settings(
        engine="qwen3-omni",
        model="preset:tiny",
        engine_options={"max_sessions": "2"},
        ws_max_message_bytes=2 * 1024 * 1024,
        webrtc_host_addresses=("127.0.0.1",),
    )
    with serve(settings) as server:
        yield server


def chat(server: RunningServer) -> Qwen3VideoChat:
    engine: Qwen3VideoChat = server.app.state.omni_engine
    return engine


def spoken_question() -> str:
    """A second of seeded noise standing for the user's speech (the preset's weights are random), 16 kHz s16le."""
    rng = np.random.default_rng(1)
    return base64.b64encode((rng.standard_normal(16000) * 3000).astype("<i2").tobytes()).decode()


async def test_frames_and_a_spoken_question_are_answered_in_text_and_the_models_voice(
    qwen3_server: RunningServer,
) -> None:
    engine = chat(qwen3_server)
    assert engine.info.voiced and engine.info.model == "preset:tiny"
    async with connect(qwen3_server.ws_url + ROUTE, max_size=None) as ws:
        await send(ws, "session.config", num_frames=2, enable_frame_filter=False, audio_format="pcm", max_new_tokens=8)
        for i in range(2):
            await send(ws, "video.frame", data=jpeg(i))
        await send(ws, "audio.chunk", data=spoken_question())
        before = qwen3_server.call(lambda: (engine.frames_encoded_total, engine.frames_reused_total))
        await send(ws, "video.query", text="")
        events = await until_terminal(ws, 0)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.start" and events[0]["frames"] == 2
        assert kinds[-2:] == ["response.text.done", "response.audio.done"], kinds
        deltas = [e["delta"] for e in events if e["type"] == "response.text.delta"]
        assert deltas and events[-2]["text"] == "".join(deltas)
        audio = [e for e in events if e["type"] == "response.audio.delta"]
        assert audio, "the answer was not spoken"
        assert all(e["format"] == "pcm" and e["sample_rate"] == VOICE_RATE for e in audio)
        assert all(len(base64.b64decode(e["data"])) == FRAME_BYTES for e in audio)
        assert events[-1]["status"] == events[-2]["status"] and events[-1]["status"] in ("completed", "max_tokens")
        # The same frames again: their vision tokens come from the session's cache, not the encoder.
        await send(ws, "video.query", text="and now?")
        events = await until_terminal(ws, 1)
        assert events[-1]["type"] == "response.audio.done"
        after = qwen3_server.call(lambda: (engine.frames_encoded_total, engine.frames_reused_total))
        await send(ws, "video.done")
        assert (await receive(ws))["type"] == "session.done"
    assert isinstance(before, tuple) and isinstance(after, tuple)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)


async def test_frames_and_audio_past_their_bounds_get_input_backpressure(
    qwen3_server: RunningServer, gated_decoding: tuple[threading.Event, list[str]]
) -> None:
    gate, _ = gated_decoding
    async with connect(qwen3_server.ws_url + ROUTE, max_size=None) as ws:
        # (The refused audio's buffer, 94 s of it, is not the question's: use_audio_in_video is off.)
        await send(ws, "session.config", modalities=["text"], max_new_tokens=4, use_audio_in_video=False)
        # Decoding waits at the gate: the session holds 8 frames being decoded, the ninth is refused.
        for i in range(9):
            await send(ws, "video.frame", data=jpeg(30 + i))
        error = await receive(ws)
        assert (error["type"], error["code"], error["param"]) == ("error", "input_backpressure", "video.frame")
        chunk = base64.b64encode(b"\x00\x00" * 750_000).decode()  # 1.5 MB: the third exceeds the 4 MiB buffer
        for _ in range(3):
            await send(ws, "audio.chunk", data=chunk)
        error = await receive(ws)
        assert (error["code"], error["param"]) == ("input_backpressure", "audio.chunk")
        gate.set()
        await send(ws, "video.query", text="what is there?")
        events = await until_terminal(ws, 0, "response.text.done")
        assert events[0] == {"type": "response.start", "query_id": 0, "frames": 4}
        assert events[-1]["status"] in ("completed", "max_tokens"), events


async def test_a_question_longer_than_the_context_is_refused_typed() -> None:
    settings = Settings(engine="qwen3-omni", model="preset:tiny", engine_options={"max_context": "128"})
    with serve(settings) as server:
        async with connect(server.ws_url + ROUTE) as ws:
            await send(ws, "session.config", max_new_tokens=4)
            await send(ws, "video.frame", data=jpeg(40))  # 144 vision tokens: more than the context alone
            await send(ws, "video.query", text="what is it?")
            events = await until_terminal(ws, 0)
    assert events[0] == {"type": "response.start", "query_id": 0, "frames": 1}
    [error] = [e for e in events if e["type"] == "error"]
    assert error["code"] == "context_length_exceeded" and "128" in error["message"]
    assert [e["status"] for e in events if e["type"].endswith(".done")] == ["error", "error"]


async def test_an_unknown_voice_is_refused_typed(qwen3_server: RunningServer) -> None:
    async with connect(qwen3_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", voice="nobody", max_new_tokens=4)
        await send(ws, "video.query", text="hello?")
        events = await until_terminal(ws, 0)
        [error] = [e for e in events if e["type"] == "error"]
        assert error["code"] == "invalid_voice" and "ethan" in error["message"]
        assert [e["status"] for e in events if e["type"].endswith(".done")] == ["error", "error"]


async def test_the_load_test_target_drives_it(qwen3_server: RunningServer) -> None:
    from omnigate.loadtest.report import TargetSpec
    from omnigate.loadtest.targets import SessionSettings, target_class
    from omnigate.loadtest.traces import SessionTrace

    spec = TargetSpec(label="video-chat", target="video-chat", url=qwen3_server.http_url)
    target = target_class("video-chat")(spec, SessionSettings(video_fps=10.0, query_every_s=0.0))
    await target.open()
    trace = SessionTrace(0, 0.0)
    await target.run_session(["What is moving?", "And now?"], trace)
    await target.close()
    # Random weights: an answer may run to its token cap (the target counts that as answer_max_tokens), nothing else.
    assert set(trace.errors) <= {"answer_max_tokens"}, trace.error_details
    assert len(trace.utterances) == 2
    assert all(u.bytes > 0 and u.ttfa_ms is not None for u in trace.utterances)


def answer_packets_sent(server: RunningServer) -> int:
    """Audio packets of answers the server's call tracks have sent (silence between answers not counted)."""

    def count() -> int:
        return sum(call.track.audio_frames_sent for call in server.app.state.webrtc.calls.values())

    sent = server.call(count)
    assert isinstance(sent, int)
    return sent


async def test_a_call_is_answered_on_the_channel_and_in_the_models_voice_on_the_track(
    qwen3_server: RunningServer,
) -> None:
    use_loopback_candidates()
    engine = chat(qwen3_server)
    encoded_before = qwen3_server.call(lambda: engine.frames_encoded_total)
    peer = Peer()
    try:
        await peer.connect(qwen3_server.http_url + CALLS)
        peer.send("session.config", num_frames=2, max_new_tokens=8)
        await peer.until(lambda: peer.camera.count >= 30)  # a second of camera (2 frames of it are taken)
        peer.send("video.query", text="What is moving?")
        await peer.until(lambda: any(e["type"] == "response.audio.done" for e in peer.events))
        kinds = [e["type"] for e in peer.events]
        assert kinds[0] == "response.start" and peer.events[0]["frames"] >= 1
        assert "response.text.delta" in kinds and kinds.count("response.text.done") == 1
        assert "response.audio.delta" not in kinds  # audio goes on the track, not the channel
        assert peer.events[-1]["status"] in ("completed", "max_tokens")
        # The tiny preset's random voice is ~1e-7 of full scale (silent as 16-bit samples): count the answer's
        # packets the call's track sent instead of listening for them.
        await peer.until(lambda: answer_packets_sent(qwen3_server) > 0)
        encoded_after = qwen3_server.call(lambda: engine.frames_encoded_total)
        assert isinstance(encoded_before, int) and isinstance(encoded_after, int) and encoded_after > encoded_before
    finally:
        await peer.close()
