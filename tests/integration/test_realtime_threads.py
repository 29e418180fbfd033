"""Realtime sessions leave no thread behind: 200 sessions served, the process has the threads it had after 10.

Every session hears real speech (the piper voice) through the server VAD, so the detector, its resampler and the
engine session all run; each session ends once the VAD has heard the speech start. WebRTC calls (an aiortc peer on
loopback that sends a microphone track) end once the server's reply is heard on the track, so the call's Opus
encoder, microphone resampler and peer connection have all run. The server runs in this process, so its threads are
this process's threads, counted at the OS level (``/proc/self/task``), where their names show.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import threading
from collections.abc import Iterator

import av
import httpx
import pytest
from aiortc.mediastreams import AudioStreamTrack
from websockets.asyncio.client import connect

from omnigate.gateway.settings import Settings
from omnigate.gateway.video_chat.call import CALLS_PATH as VIDEO_CHAT_CALLS
from omnigate.gateway.video_chat.call import CHANNEL as VIDEO_CHAT_CHANNEL
from omnigate.gateway.webrtc.call import REALTIME_CHANNEL, SPEECH_CHANNEL
from omnigate.loadtest.targets.webrtc import CALLS_PATH, SpeechPeer, is_silent, use_loopback_candidates
from omnigate.os_threads import os_thread_name
from tests.integration.test_realtime_ws import user_speech  # noqa: F401 - the fixture
from tests.integration.test_webrtc import LOOPBACK, on_server
from tests.integration.test_webrtc_video_chat import Camera
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

SESSIONS = 200
WARM_UP = 10
AT_ONCE = 10
# Threads a pool may add after the warm-up by reaching its configured size later (the default executor's lazily
# started workers); what sessions would leave behind grows with the 190 sessions served after the count.
SLACK = 4
READ_LIMIT_S = 30.0
# Each call held an Opus encoder whose FFmpeg filter graph had one thread per core: 40 calls show that growth.
CALLS = 40
CALLS_WARM_UP = 10
CALLS_AT_ONCE = 5
DECODERS = ("audio-decoder", "video-decoder")
CLIENT_POOL = "asyncio_"


@pytest.fixture(scope="module")
def tts_vad_server() -> Iterator[RunningServer]:
    """A text-to-speech engine; realtime sessions turn-detect with the server VAD (the default)."""
    with serve(Settings(engine="synthetic")) as server:
        yield server


@pytest.fixture(scope="module")
def duplex_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="duplex", model="preset:tiny", engine_options={"max_sessions": str(AT_ONCE)})) as s:
        yield s


@pytest.fixture(scope="module")
def rtc_duplex_server() -> Iterator[RunningServer]:
    settings = Settings(
        engine="duplex",
        model="preset:tiny",
        engine_options={"max_sessions": str(CALLS_AT_ONCE)},
        webrtc_host_addresses=LOOPBACK,
    )
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def rtc_video_chat_server() -> Iterator[RunningServer]:
    # Slots admission: five answers start at once beside the tiny thinker on two cores, which headroom admission may
    # rightly refuse; what is counted here is threads.
    settings = Settings(engine="synthetic", omni_model="preset:tiny", webrtc_host_addresses=LOOPBACK, admission="slots")
    with serve(settings) as server:
        yield server


@pytest.fixture(scope="module")
def rtc_tts_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK)) as server:
        yield server


def os_threads() -> dict[int, str]:
    names: dict[int, str] = {}
    for entry in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended while listed
            names[int(entry)] = os_thread_name(int(entry))
    return names


def server_threads() -> dict[int, str]:
    """The process's threads but the client's pool and aiortc's decoder threads.

    The client's loop runs aiortc's encoders on its default pool (``asyncio_N``); aiortc decodes each inbound track,
    on either side, on a thread of its own that the call's end joins.
    """
    left_out = {t.native_id for t in threading.enumerate() if t.name.startswith(CLIENT_POOL) or t.name in DECODERS}
    return {tid: name for tid, name in os_threads().items() if tid not in left_out}


async def one_session(server: RunningServer, speech_event: str) -> None:
    async with connect(server.ws_url + "/v1/realtime", compression=None, max_size=None) as ws:
        async with asyncio.timeout(READ_LIMIT_S):
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            if created["session"]["capabilities"]["native_duplex"]:
                # A duplex session starts without server VAD; asked for, it runs the same resampler and scoring.
                vad = {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
                await ws.send(json.dumps({"type": "session.update", "session": vad}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": speech_event}))
            while json.loads(await ws.recv())["type"] != "input_audio_buffer.speech_started":
                pass


async def serve_sessions(server: RunningServer, audio: str, count: int) -> None:
    for _ in range(count // AT_ONCE):
        await asyncio.gather(*(one_session(server, audio) for _ in range(AT_ONCE)))


async def settled(server: RunningServer) -> None:
    """Every session's scope has ended on the server."""
    while server.call(lambda: server.gateway.registry.total_active):  # noqa: ASYNC110 - polls the server's state
        await asyncio.sleep(0.05)


async def one_call(server: RunningServer, channel: str, all_heard: asyncio.Barrier) -> None:
    """One call that lasts until the server's reply is heard on the track by every call of its batch."""
    heard = asyncio.Event()
    errors: list[str] = []

    def on_event(message: str, _now_s: float) -> None:
        if json.loads(message)["type"] == "error":
            errors.append(message)
            heard.set()  # no reply is coming: fail at once, with the error

    def on_audio(frame: av.AudioFrame, _now_s: float) -> None:
        if not is_silent(frame):
            heard.set()

    peer = SpeechPeer(on_event, on_audio, AudioStreamTrack(), channel)  # aiortc's paced silence: the microphone
    if channel == VIDEO_CHAT_CHANNEL:
        peer.pc.addTrack(Camera())
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            path = VIDEO_CHAT_CALLS if channel == VIDEO_CHAT_CHANNEL else CALLS_PATH
            await asyncio.wait_for(peer.connect(client, server.http_url + path), READ_LIMIT_S)
        if channel == SPEECH_CHANNEL:
            peer.send_json({"type": "session.config"})
            peer.send_json({"type": "input.text", "text": "A reply to hear."})
            peer.send_json({"type": "input.done"})
        elif channel == VIDEO_CHAT_CHANNEL:
            peer.send_json({"type": "session.config", "num_frames": 2, "max_new_tokens": 8})
            peer.send_json({"type": "video.query", "text": "What is moving?"})
        # The duplex model speaks on its own clock; nothing to ask.
        await asyncio.wait_for(heard.wait(), READ_LIMIT_S)
        assert not errors, errors
        await asyncio.wait_for(all_heard.wait(), READ_LIMIT_S)
    finally:
        await peer.close()


async def serve_calls(server: RunningServer, channel: str, count: int) -> int:
    """Serve ``count`` calls, a batch at a time; the most threads seen while a whole batch was live and heard."""
    most = 0
    for _ in range(count // CALLS_AT_ONCE):
        # One more party than calls: the counter, which counts while every call has played audio and none has ended.
        all_heard = asyncio.Barrier(CALLS_AT_ONCE + 1)
        calls = asyncio.gather(*(one_call(server, channel, all_heard) for _ in range(CALLS_AT_ONCE)))
        try:
            await asyncio.wait_for(all_heard.wait(), READ_LIMIT_S)
            most = max(most, len(server_threads()))
        finally:
            await calls
    await on_server(server, server.app.state.webrtc.join())
    await settled(server)
    return most


@pytest.mark.parametrize(
    ("engine", "channel"),
    [
        ("rtc_duplex_server", REALTIME_CHANNEL),
        ("rtc_tts_server", SPEECH_CHANNEL),
        ("rtc_video_chat_server", VIDEO_CHAT_CHANNEL),
    ],
)
async def test_webrtc_calls_leave_no_thread_behind(engine: str, channel: str, request: pytest.FixtureRequest) -> None:
    server: RunningServer = request.getfixturevalue(engine)
    use_loopback_candidates()
    live_in_warm_up = await serve_calls(server, channel, CALLS_WARM_UP)
    after_warm_up = server_threads()
    live_later = await serve_calls(server, channel, CALLS - CALLS_WARM_UP)
    after_all = server_threads()
    # A call's codecs run on the server's pools, so live calls hold no threads of their own, and ended ones leave none.
    assert live_in_warm_up <= len(after_warm_up) + SLACK
    assert live_later <= len(after_warm_up) + SLACK
    assert len(after_all) <= len(after_warm_up) + SLACK, sorted(after_all.values())
    born = {tid: name for tid, name in after_all.items() if tid not in after_warm_up}
    assert all(name.startswith("omnigate-") for name in born.values()), born


@pytest.mark.parametrize("engine", ["tts_vad_server", "duplex_server"])
async def test_200_realtime_sessions_leave_no_thread_behind(
    engine: str,
    request: pytest.FixtureRequest,
    user_speech: bytes,  # noqa: F811
) -> None:
    server: RunningServer = request.getfixturevalue(engine)
    audio = base64.b64encode(user_speech).decode()
    await serve_sessions(server, audio, WARM_UP)
    await settled(server)
    after_warm_up = os_threads()
    await serve_sessions(server, audio, SESSIONS - WARM_UP)
    await settled(server)
    after_all = os_threads()
    assert len(after_all) <= len(after_warm_up) + SLACK, sorted(after_all.values())
    born = {tid: name for tid, name in after_all.items() if tid not in after_warm_up}
    assert all(name.startswith("omnigate-") for name in born.values()), born
