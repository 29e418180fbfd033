"""``WS /v1/video/chat/stream`` against the real server: the tiny random-weight omni preset on the CPU answering in
text, the synthetic speech engine speaking the answer, a websockets client sending JPEG frames and PCM audio.

Order is asserted from the events' own sequence, never from elapsed time.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile
from websockets.asyncio.client import ClientConnection, connect

from omnigate.engines.omni.engine import OmniEngine
from omnigate.engines.omni.request import EncoderCache
from omnigate.gateway.settings import Settings
from omnigate.gateway.video_chat import frames
from omnigate.gateway.video_chat.image_budget import FrameBudget
from omnigate.sessions.video_chat import Action, DecodedFrame, VideoChatSession
from tests import image_bombs
from tests.fuzz.server import settle
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

ROUTE = "/v1/video/chat/stream"


@pytest.fixture(scope="module")
def chat_server() -> Iterator[RunningServer]:
    settings = Settings(engine="synthetic", omni_model="preset:tiny", ws_max_message_bytes=2 * 1024 * 1024)
    with serve(settings) as server:
        yield server


def omni(server: RunningServer) -> OmniEngine:
    engine: OmniEngine = server.app.state.omni_engine
    return engine


def jpeg(seed: int, size: tuple[int, int] = (160, 120)) -> str:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG")
    return base64.b64encode(buffer.getvalue()).decode()


async def send(ws: ClientConnection, event_type: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": event_type, **fields}))


async def receive(ws: ClientConnection) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(message, str)
    event: dict[str, Any] = json.loads(message)
    return event


async def until_terminal(
    ws: ClientConnection, query_id: int, terminal: str = "response.audio.done"
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        event = await receive(ws)
        events.append(event)
        if event["type"] == terminal and event.get("query_id") == query_id:
            return events


async def test_a_question_about_frames_is_answered_in_text_then_speech(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", num_frames=2, max_frames=8, max_new_tokens=48)
        for i in range(3):
            await send(ws, "video.frame", data=jpeg(i))
        await send(ws, "video.query", text="What is on the table?")
        events = await until_terminal(ws, 0)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.start" and events[0]["frames"] == 2
        assert kinds.count("response.text.done") == 1 and kinds[-1] == "response.audio.done"
        text_done = kinds.index("response.text.done")
        assert all(k == "response.text.delta" for k in kinds[1:text_done]) and text_done > 1
        done = events[text_done]
        assert done["text"] == "".join(e["delta"] for e in events[1:text_done])
        audio = [e for e in events if e["type"] == "response.audio.delta"]
        assert audio, "the answer was not spoken"
        for delta in audio:
            assert delta["format"] == "wav"
            with wave.open(io.BytesIO(base64.b64decode(delta["data"]))) as wav:
                assert wav.getframerate() == delta["sample_rate"] and wav.getnframes() > 0
        assert events[-1]["status"] == "completed"
        await send(ws, "video.done")
        assert await receive(ws) == {"type": "session.done", "reason": "client_done"}


async def test_pcm_audio_and_a_spoken_question(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", audio_format="pcm", max_new_tokens=24, use_audio_in_video=True)
        await send(ws, "video.frame", data=jpeg(5))
        tone = (np.sin(np.arange(16000) * 0.05) * 8000).astype("<i2").tobytes()
        await send(ws, "audio.chunk", data=base64.b64encode(tone).decode())
        await send(ws, "video.query", text="")
        events = await until_terminal(ws, 0)
        audio = [e for e in events if e["type"] == "response.audio.delta"]
        assert audio and all(e["format"] == "pcm" for e in audio)
        assert sum(len(base64.b64decode(e["data"])) for e in audio) % 2 == 0


async def test_a_new_query_cancels_the_answer_in_flight(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", max_new_tokens=1024, modalities=["text", "audio"])
        await send(ws, "video.query", text="Tell me a long story.")
        first = await receive(ws)
        assert first["type"] == "response.start"
        assert (await receive(ws))["type"] == "response.text.delta"
        await send(ws, "session.config", max_new_tokens=16)
        await send(ws, "video.query", text="Stop. What now?")
        events = await until_terminal(ws, 1)
        of_first = [e for e in events if e.get("query_id") == 0]
        terminals = [e for e in of_first if e["type"] == "response.audio.done"]
        assert len(terminals) == 1 and terminals[0]["status"] == "cancelled"
        assert of_first.index(terminals[0]) == len(of_first) - 1, "query 0 produced events after its terminal"
        text_done = [e for e in of_first if e["type"] == "response.text.done"]
        assert len(text_done) == 1 and text_done[0]["status"] == "cancelled"
        assert events[-1]["status"] == "completed"


async def test_unchanged_frames_reuse_their_vision_tokens(chat_server: RunningServer) -> None:
    engine = omni(chat_server)
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", num_frames=2, enable_frame_filter=False, modalities=["text"], max_new_tokens=4)
        await send(ws, "video.frame", data=jpeg(11))
        await send(ws, "video.frame", data=jpeg(12))
        before = chat_server.call(lambda: (engine.frames_encoded_total, engine.frames_reused_total))
        await send(ws, "video.query", text="first")
        await until_terminal(ws, 0, "response.text.done")
        first = chat_server.call(lambda: (engine.frames_encoded_total, engine.frames_reused_total))
        await send(ws, "video.query", text="second, same frames")
        await until_terminal(ws, 1, "response.text.done")
        after = chat_server.call(lambda: (engine.frames_encoded_total, engine.frames_reused_total))
    assert isinstance(before, tuple) and isinstance(first, tuple) and isinstance(after, tuple)
    assert after[0] - before[0] == 2  # each frame encoded once (as it arrived, or for the first query)
    assert after[1] - first[1] == 2  # and reused by the second query


async def test_frames_sent_before_a_question_are_encoded_before_it_is_asked(
    chat_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = omni(chat_server)
    pictures = [jpeg(121), jpeg(122)]  # seeds no other test sends
    # The digests the server gives these frames (of their pixels at the model's frame size).
    digests = {frames.decode_frame(p, engine.info.frame_size, FrameBudget()).frame.digest for p in pictures}
    stored = threading.Event()
    put = EncoderCache.put

    def watched_put(cache: EncoderCache, digest: bytes, tokens: Any) -> None:
        put(cache, digest, tokens)
        if all(d in cache for d in digests):
            stored.set()

    monkeypatch.setattr(EncoderCache, "put", watched_put)
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", num_frames=2, enable_frame_filter=False, modalities=["text"], max_new_tokens=4)
        before = chat_server.call(lambda: (engine.frames_ahead_total, engine.frames_encoded_total))
        for picture in pictures:
            await send(ws, "video.frame", data=picture)
        assert await asyncio.to_thread(stored.wait, 60), "the frames were not encoded before a question asked"
        await send(ws, "video.query", text="what changed?")
        events = await until_terminal(ws, 0, "response.text.done")
        after = chat_server.call(lambda: (engine.frames_ahead_total, engine.frames_encoded_total))
    assert events[0] == {"type": "response.start", "query_id": 0, "frames": 2}
    assert isinstance(before, tuple) and isinstance(after, tuple)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)  # both encoded ahead; the question encoded none


async def test_inputs_beyond_their_bounds_and_bad_inputs_are_refused_typed(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        chunk = base64.b64encode(b"\x00\x00" * 750_000).decode()  # 1.5 MB: the third exceeds the 4 MiB buffer
        for _ in range(3):
            await send(ws, "audio.chunk", data=chunk)
        error = await receive(ws)
        assert error["type"] == "error" and error["code"] == "input_backpressure" and error["param"] == "audio.chunk"
        await send(ws, "video.frame", data="not base64!")
        assert (await receive(ws))["code"] == "invalid_base64"
        await send(ws, "video.frame", data=base64.b64encode(b"GIF89a not a picture").decode())
        assert (await receive(ws))["code"] == "invalid_frame"
        await send(ws, "video.teleport")
        assert (await receive(ws))["code"] == "unknown_event"
        await send(ws, "session.config", num_frames=500)
        error = await receive(ws)
        assert error["code"] == "invalid_config" and error["param"] == "num_frames"
        await send(ws, "ping")
        assert await receive(ws) == {"type": "pong"}


async def test_a_gateway_without_an_omni_model_refuses_typed() -> None:
    with serve(Settings(engine="synthetic")) as server:
        async with connect(server.ws_url + ROUTE) as ws:
            error = await receive(ws)
            assert error["code"] == "video_chat_unavailable"
            await ws.wait_closed()
            assert ws.close_code == 4404


async def test_the_load_test_target_records_each_spoken_answer(chat_server: RunningServer) -> None:
    from omnigate.loadtest.report import TargetSpec
    from omnigate.loadtest.targets import SessionSettings, target_class
    from omnigate.loadtest.traces import SessionTrace

    spec = TargetSpec(label="video-chat", target="video-chat", url=chat_server.http_url)
    target = target_class("video-chat")(spec, SessionSettings(video_fps=10.0, query_every_s=0.0))
    await target.open()
    trace = SessionTrace(0, 0.0)
    await target.run_session(["What is moving?", "And now?"], trace)
    await target.close()
    assert not trace.errors, trace.error_details
    assert [u.status for u in trace.utterances] == ["completed", "completed"]
    assert all(u.bytes > 0 and u.ttfa_ms is not None for u in trace.utterances)


async def test_a_prompt_longer_than_the_thinkers_context_is_refused_typed() -> None:
    settings = Settings(engine="synthetic", omni_model="preset:tiny", omni_options={"max_context": "32"})
    with serve(settings) as server:
        async with connect(server.ws_url + ROUTE) as ws:
            await send(ws, "session.config", modalities=["text"])  # the system prompt alone is over 32 tokens
            await send(ws, "video.frame", data=jpeg(3))
            await send(ws, "video.query", text="What is this?")
            events = await until_terminal(ws, 0, "response.text.done")
            [error] = [e for e in events if e["type"] == "error"]
            assert error["code"] == "context_length_exceeded" and "32 tokens" in error["message"]
            assert events[-1]["status"] == "error" and events[-1]["text"] == ""
            await send(ws, "video.done")
            assert await receive(ws) == {"type": "session.done", "reason": "client_done"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_picture_bombs_are_refused_typed_and_the_session_goes_on(chat_server: RunningServer) -> None:
    """A few kilobytes of PNG whose zTXt or iCCP chunk inflates to megabytes once killed the session's frame
    decoder: no error, and every later query waited forever."""
    async with connect(chat_server.ws_url + ROUTE, max_size=None) as ws:
        await send(ws, "session.config", modalities=["text"], max_new_tokens=4)
        for bomb in (image_bombs.ztxt_bomb(), image_bombs.iccp_bomb(), image_bombs.text_bomb()):
            await send(ws, "video.frame", data=b64(bomb))
        await send(ws, "video.frame", data=jpeg(21))
        await send(ws, "video.query", text="What is there?")
        events = await until_terminal(ws, 0, "response.text.done")
    errors = [e for e in events if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [("input_too_large", "video.frame")] * 3, errors
    assert events[len(errors)] == {"type": "response.start", "query_id": 0, "frames": 1}
    assert events[-1]["status"] in ("completed", "max_tokens")
    await settle(chat_server)  # no session and no engine stream left


async def test_a_frame_decoder_that_dies_ends_its_session_typed_and_releases_it(
    chat_server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    gated_decoding: tuple[threading.Event, list[str]],
) -> None:
    def broken(self: VideoChatSession, frame: DecodedFrame) -> list[Action]:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(VideoChatSession, "on_frame", broken)
    gate, _ = gated_decoding
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", modalities=["text"])
        await send(ws, "video.frame", data=jpeg(22))
        await send(ws, "video.query", text="Anything?")
        # The pong says the question waits for the frame; only then does the frame's decoding end (and the decoder die).
        await send(ws, "ping")
        assert (await receive(ws))["type"] == "pong"
        gate.set()
        events = [await receive(ws) for _ in range(3)]
        await ws.wait_closed()
    assert events[:2] == [
        {"type": "response.start", "query_id": 0, "frames": 0},
        {"type": "response.text.done", "query_id": 0, "text": "", "status": "cancelled"},
    ]
    assert events[2]["code"] == "internal_error" and events[2]["fatal"] and "injected fault" in events[2]["message"]
    assert ws.close_code == 1011
    await settle(chat_server)  # no session and no engine stream left


@pytest.fixture
def gated_decoding(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """Frame decoding that waits for the test to open the gate, recording the threads it ran on."""
    gate = threading.Event()
    threads: list[str] = []
    real = frames.decode_frame

    def gated(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(frames, "decode_frame", gated)
    try:
        yield gate, threads
    finally:
        gate.set()


async def test_a_query_replaced_while_frames_decode_gets_its_final_event(
    chat_server: RunningServer, gated_decoding: tuple[threading.Event, list[str]]
) -> None:
    gate, _ = gated_decoding
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", max_new_tokens=4)
        await send(ws, "video.frame", data=jpeg(23))
        await send(ws, "video.query", text="first")
        await send(ws, "video.query", text="second")
        await send(ws, "ping")  # answered once the reader has taken both queries, while the frame still decodes
        replaced = [await receive(ws) for _ in range(4)]
        gate.set()
        events = await until_terminal(ws, 1)
    assert replaced == [
        {"type": "response.start", "query_id": 0, "frames": 0},
        {"type": "response.text.done", "query_id": 0, "text": "", "status": "cancelled"},
        {"type": "response.audio.done", "query_id": 0, "status": "cancelled"},
        {"type": "pong"},
    ]
    assert events[0] == {"type": "response.start", "query_id": 1, "frames": 1}
    assert events[-1]["status"] == "completed"
    assert not any(e.get("query_id") == 0 for e in events)


async def test_frames_decode_on_their_own_pool_and_oversize_is_refused_before_decoding(
    chat_server: RunningServer, gated_decoding: tuple[threading.Event, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, threads = gated_decoding
    gate.set()
    loaded: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def recorded_load(self: ImageFile.ImageFile) -> Any:
        loaded.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recorded_load)
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", modalities=["text"], max_new_tokens=4)
        await send(ws, "video.frame", data=b64(image_bombs.huge_png(6000)))
        await send(ws, "video.frame", data=jpeg(24))
        await send(ws, "video.query", text="What now?")
        events = await until_terminal(ws, 0, "response.text.done")
    [error] = [e for e in events if e["type"] == "error"]
    assert error["code"] == "input_too_large" and "6000x6000" in error["message"]
    assert (6000, 6000) not in loaded, "the oversize frame's pixels were decoded"
    assert len(threads) == 2 and all(name.startswith("omnigate-image-decode") for name in threads), threads


async def test_live_video_chat_sessions_are_counted_in_the_metrics(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "ping")
        assert await receive(ws) == {"type": "pong"}
        async with httpx.AsyncClient(base_url=chat_server.http_url) as client:
            metrics = (await client.get("/metrics")).text
    assert 'omnigate_sessions_active{transport="video-chat"} 1.0' in metrics
    assert 'omnigate_sessions_active{transport="webrtc-video-chat"} 0.0' in metrics


async def test_the_thinkers_worker_loop_is_in_the_metrics(chat_server: RunningServer) -> None:
    async with connect(chat_server.ws_url + ROUTE) as ws:
        await send(ws, "session.config", num_frames=1, max_new_tokens=8)
        await send(ws, "video.frame", data=jpeg(40))
        await send(ws, "video.query", text="What is it?")
        await until_terminal(ws, 0, "response.text.done")
        async with httpx.AsyncClient(base_url=chat_server.http_url) as client:
            metrics = (await client.get("/metrics")).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("omnigate_omni_") and " " in line
    }
    engine = omni(chat_server)
    assert values["omnigate_omni_steps_total"] >= 1
    assert values["omnigate_omni_prefilled_prompts_total"] >= 1
    assert values["omnigate_omni_prefill_tokens_total"] == engine.prefill_tokens_total
    assert values["omnigate_omni_decode_rows_total"] == engine.decode_rows_total
    for gauge in ("steps_per_second", "rows_per_step", "prefill_tokens_per_step"):
        assert f"omnigate_omni_{gauge}" in values
