"""A task serving a speech session that dies ends its session typed and frees everything: the WebSocket speech
stream, ``POST /v1/audio/speech`` (plain and SSE) and a WebRTC speech call, against the real server in-process, with
the audio encoder made to raise on its first chunk.

The client gets ``error`` ``internal_error`` and its utterance's ``session.done`` (WebSocket: then close 1011; HTTP:
an aborted body, over SSE after the error event); the admission slot and the engine stream are released.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiortc.mediastreams import AudioStreamTrack, MediaStreamTrack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from omnigate.codecs.rtc_audio import RtcOpusStream
from omnigate.gateway.settings import Settings
from omnigate.gateway.speech.audio_out import AudioOut
from omnigate.gateway.webrtc import call as webrtc_call
from tests.integration.test_speech_http_integrity import wait_until_no_sessions
from tests.integration.test_webrtc import LOOPBACK, Listener, call, on_server
from tests.integration.ws_client import send
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

TEXT = "The encoder dies on the first chunk of this sentence. " * 4
LIMIT_S = 20.0


class InjectedFault(RuntimeError):
    pass


def die(*args: object) -> bytes:
    raise InjectedFault("the encoder died")


@pytest.fixture
def server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", webrtc_host_addresses=LOOPBACK)) as running:
        yield running


def assert_released(server: RunningServer) -> None:
    pool = server.gateway.pool
    assert pool is not None
    assert server.call(lambda: pool.admission.active) == 0
    assert server.call(lambda: server.gateway.registry.total_active) == 0


async def read_until_closed(ws: ClientConnection, into: list[dict[str, Any]]) -> None:
    while True:
        message = await ws.recv()
        assert isinstance(message, str)  # no audio: the encoder died on the first chunk
        into.append(json.loads(message))


async def test_a_dying_encoder_ends_a_speech_stream_typed(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AudioOut, "encode", die)
    events: list[dict[str, Any]] = []
    async with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        await send(ws, "session.config", response_format="mp3")
        await send(ws, "input.text", text=TEXT)
        await send(ws, "input.done")
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(read_until_closed(ws, events), LIMIT_S)
    assert ws.close_code == 1011
    kinds = [e["type"] for e in events]
    assert kinds == ["audio.start", "session.done", "error"], events
    assert events[1]["status"] == "cancelled"
    assert events[2]["code"] == "internal_error"
    await wait_until_no_sessions(server)
    assert_released(server)


async def test_a_dying_encoder_cuts_an_sse_speech_response_off_typed(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AudioOut, "encode", die)
    body = {"model": "synthetic", "voice": "tone", "input": TEXT, "response_format": "mp3"}
    lines: list[str] = []
    async with (
        httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client,
        client.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):  # aborted: never a complete body
            await collect_lines(response, lines)
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["error"]
    assert events[0]["error"]["code"] == "internal_error"
    await wait_until_no_sessions(server)
    assert_released(server)


async def collect_lines(response: httpx.Response, into: list[str]) -> None:
    async for line in response.aiter_lines():
        into.append(line)


async def test_a_dying_encoder_ends_a_webrtc_speech_call_typed(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RtcOpusStream, "encode", die)
    listener = Listener()
    async with call(server, listener) as peer:
        peer.send_json({"type": "session.config"})
        peer.send_json({"type": "input.text", "text": TEXT})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: bool(listener.of("error")))
    await on_server(server, server.app.state.webrtc.join())
    assert [e["type"] for e in listener.events] == ["audio.start", "session.done", "error"], listener.events
    assert listener.events[1]["status"] == "cancelled"
    assert listener.events[2]["code"] == "internal_error"
    assert server.gateway.registry.active.get("webrtc", 0) == 0
    assert_released(server)


async def test_a_dying_microphone_task_ends_a_webrtc_speech_call_typed(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_now = threading.Event()  # set by the test, read on the server's loop

    async def consume_then_die(track: MediaStreamTrack, on_pcm: Callable[[bytes], None]) -> None:
        while not fail_now.is_set():
            await track.recv()
        raise InjectedFault("the microphone reader died")

    monkeypatch.setattr(webrtc_call, "consume_microphone", consume_then_die)
    listener = Listener()
    async with call(server, listener, AudioStreamTrack()) as peer:
        peer.send_json({"type": "session.config"})
        peer.send_json({"type": "input.text", "text": "A short sentence first."})
        peer.send_json({"type": "input.done"})
        await listener.until(lambda: listener.done(0) is not None)  # the call works, its channel is bound
        fail_now.set()
        await listener.until(lambda: bool(listener.of("error")))
        await on_server(server, server.app.state.webrtc.join())
    assert [e["code"] for e in listener.of("error")] == ["internal_error"]
    assert server.gateway.registry.active.get("webrtc", 0) == 0
    assert_released(server)
