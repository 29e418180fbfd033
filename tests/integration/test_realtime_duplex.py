"""Full-duplex sessions with the duplex engine (``preset:tiny``), driven by the ``openai`` SDK's realtime client."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from websockets.asyncio.client import connect as ws_connect

from omnigate.gateway.settings import Settings
from omnigate.loadtest.metrics import parse_metrics
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until
from tests.serving import RunningServer, serve
from tests.unit.test_realtime_protocol import validate_server_event

pytestmark = pytest.mark.integration

FRAME_BYTES = 3840  # 80 ms of 24 kHz s16le


@pytest.fixture(scope="module")
def beside_tts() -> Iterator[RunningServer]:
    """A TTS main engine with a one-session duplex engine beside it."""
    settings = Settings(
        engine="synthetic",
        duplex_model="preset:tiny",
        duplex_options={"max_sessions": "1", "retry_after_s": "2"},
        realtime_input_max_bytes=10 * FRAME_BYTES,
    )
    with serve(settings) as server:
        yield server


async def next_error(connection: AsyncRealtimeConnection) -> dict[str, Any]:
    """The next error event; the model's own responses may come in between."""
    while (event := await recv(connection))["type"] != "error":
        pass
    return event


async def stream_audio(connection: AsyncRealtimeConnection, frames: int, append_ms: int = 40) -> None:
    """A real-time client: ``append_ms`` of (quiet) microphone audio per append, paced by the wall clock."""
    chunk = base64.b64encode(b"\x20\x00" * (24 * append_ms)).decode()
    for _ in range(frames * 80 // append_ms):
        await connection.input_audio_buffer.append(audio=chunk)
        await asyncio.sleep(append_ms / 1000)


async def test_a_duplex_session_speaks_while_listening_and_cancels_cleanly(beside_tts: RunningServer) -> None:
    async with realtime(beside_tts, duplex="1") as connection:
        created = await recv(connection)
        capabilities = created["session"]["capabilities"]
        assert capabilities["native_duplex"] and capabilities["engine"] == "duplex"
        assert created["session"]["audio"]["input"]["turn_detection"] is None  # the model takes its own turns
        sender = asyncio.create_task(stream_audio(connection, 40))
        try:
            opened = await until(connection, "response.content_part.added")
            response_id = opened[-1]["response_id"]
            assert [e["type"] for e in opened[-4:]] == [
                "response.created",
                "response.output_item.added",
                "conversation.item.added",
                "response.content_part.added",
            ]
            audio = await until(connection, "response.output_audio.delta")
            while len(pcm_of(audio, response_id)) < 3 * FRAME_BYTES:
                audio.append(await recv(connection))
            await connection.response.cancel()
            rest = await until(connection, "response.done")
            async with httpx.AsyncClient(base_url=beside_tts.http_url) as client:
                metrics = parse_metrics((await client.get("/metrics")).text)
        finally:
            sender.cancel()
    # The clock's counters reach /metrics: the frames just heard were ticks (eager on the CPU), none captured.
    value = {key: number for key, (_, number) in metrics.items()}
    assert value['omnigate_duplex_ticks_total{mode="eager"}'] >= 3
    assert value['omnigate_duplex_ticks_total{mode="graph"}'] == value["omnigate_duplex_graph_captures_total"] == 0
    assert value["omnigate_duplex_frames_total"] >= 3 and value["omnigate_duplex_sessions"] == 1
    assert value["omnigate_duplex_step_seconds_count"] >= 3
    done = rest[-1]["response"]
    assert done["id"] == response_id and done["status"] == "cancelled"
    assert done["status_details"]["reason"] == "client_cancelled"
    assert done["usage"]["output_token_details"]["audio_tokens"] >= 3
    assert len(pcm_of(audio + rest, response_id)) % FRAME_BYTES == 0  # whole 80 ms frames, 24 kHz


async def test_duplex_refusals_and_limits(beside_tts: RunningServer) -> None:
    async with realtime(beside_tts, model="preset:tiny") as connection:  # its model name selects the duplex engine
        assert (await recv(connection))["session"]["capabilities"]["native_duplex"]
        # The one duplex slot is taken: a second session is refused, typed, with a retry hint.
        async with ws_connect(beside_tts.ws_url + "/v1/duplex") as second:
            refusal = json.loads(await second.recv())
            validate_server_event(refusal)
            assert refusal["error"]["code"] == "resource_exhausted" and "retry after 2s" in refusal["error"]["message"]
            await second.wait_closed()
            assert second.close_code == 1013
        await connection.send({"type": "response.create", "event_id": "r1"})
        error = await next_error(connection)
        assert error["error"]["code"] == "unsupported" and error["error"]["event_id"] == "r1"
        await connection.send(
            {
                "type": "conversation.item.create",
                "event_id": "i1",
                "item": {"type": "message", "role": "user", "content": []},
            }
        )
        assert (await next_error(connection))["error"]["event_id"] == "i1"
        full = base64.b64encode(bytes(10 * FRAME_BYTES)).decode()  # the whole input cap at once
        await connection.send({"type": "input_audio_buffer.append", "event_id": "a1", "audio": full})
        await connection.send({"type": "input_audio_buffer.append", "event_id": "a2", "audio": full})
        error = await next_error(connection)
        assert error["error"]["code"] == "input_backpressure" and error["error"]["event_id"] == "a2"
    # The plain route on this server stays turn-based on the TTS engine.
    async with realtime(beside_tts) as connection:
        assert not (await recv(connection))["session"]["capabilities"]["native_duplex"]


async def test_a_duplex_main_engine_serves_the_plain_route() -> None:
    settings = Settings(engine="duplex", model="preset:tiny", engine_options={"max_sessions": "2"})
    with serve(settings) as server:
        async with realtime(server) as connection:
            assert (await recv(connection))["session"]["capabilities"]["native_duplex"]
        async with ws_connect(server.ws_url + "/v1/realtime?duplex=0") as ws:
            refusal = json.loads(await ws.recv())
            assert refusal["error"]["code"] == "turn_based_unsupported"
