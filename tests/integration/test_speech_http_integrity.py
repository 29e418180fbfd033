"""``POST /v1/audio/speech`` ends cleanly only when the speech is complete, and never waits forever on a client.

A response cut off after its audio began (the engine failed, the session was closed) is aborted: no terminating
chunk, so httpx (like every HTTP client) raises instead of handing back a cut-off file as whole; over SSE an
``error`` event comes first. A client that stops reading is dropped at the stall timeout and frees its session.
Clients that disconnect while their audio is being encoded cost nothing. Waits are on protocol events or on server
state, each bounded by a deadline that only ends a failing run.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import httpx
import pytest

from omnigate.gateway.settings import Settings
from tests.integration.test_engine_faults import FaultEngine
from tests.serving import RunningServer, serve

SPEECH = "/v1/audio/speech"
LONG_TEXT = "This answer is long enough that it cannot all be generated ahead of the listener. " * 12
LIMIT_S = 20.0


def body(fmt: str = "pcm", **extra: object) -> dict[str, object]:
    return {"model": "tts-1", "voice": "alloy", "input": LONG_TEXT, "response_format": fmt, **extra}


async def stream_into(
    client: httpx.AsyncClient,
    request: dict[str, object],
    chunks: list[bytes],
    on_chunk: Callable[[], None] | None = None,
) -> None:
    """Read a 200 streamed response into ``chunks``, calling ``on_chunk`` after each one."""
    async with client.stream("POST", SPEECH, json=request) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk()


async def wait_for_sessions(server: RunningServer, count: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIMIT_S
    while server.call(lambda: server.gateway.registry.total_active) != count:
        assert loop.time() < deadline, f"the server never held {count} sessions"
        await asyncio.sleep(0.05)


async def wait_until_no_sessions(server: RunningServer) -> None:
    await wait_for_sessions(server, 0)


async def test_an_engine_failure_after_audio_began_aborts_the_body() -> None:
    engine = FaultEngine()
    with serve(Settings(engine="synthetic"), engine=engine) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client:
            chunks: list[bytes] = []

            def fail_from_now_on() -> None:
                # The engine generates at most the outbox's few seconds ahead of this reader.
                engine.failing = True

            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                await stream_into(client, body(), chunks, fail_from_now_on)
            assert chunks
            engine.failing = False
            # The server goes on: the next request is whole.
            short = {**body(), "input": "Fine again."}
            response = await client.post(SPEECH, json=short)
            assert response.status_code == 200 and len(response.content) > 0
        await wait_until_no_sessions(server)


async def test_over_sse_a_cut_off_stream_gets_an_error_event_then_is_aborted() -> None:
    engine = FaultEngine()
    with serve(Settings(engine="synthetic"), engine=engine) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client:
            chunks: list[bytes] = []

            def fail_from_now_on() -> None:
                engine.failing = True

            with pytest.raises(httpx.RemoteProtocolError):
                await stream_into(client, body(stream_format="sse"), chunks, fail_from_now_on)
            lines = b"".join(chunks).decode().split("\n\n")
            events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
            kinds = [e["type"] for e in events]
            assert kinds[0] == "speech.audio.delta" and kinds[-1] == "error" and "speech.audio.done" not in kinds
            error = events[-1]["error"]
            assert isinstance(error, dict) and error["code"] == "generation_failed" and error["type"] == "server_error"
        await wait_until_no_sessions(server)


async def test_a_session_closed_mid_speech_aborts_the_body() -> None:
    # Generation in real time, so the session still speaks when it is ended, as its maximum duration ends it, once
    # the client has audio (a timer that could run out before the first chunk would decide nothing of the body).
    with serve(Settings(engine="synthetic", model="rtf=1")) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client:
            chunks: list[bytes] = []

            def end_the_session() -> None:
                for lease in list(server.gateway.registry.leases):
                    if lease.driver is not None:
                        lease.driver.fail("max_duration", "the session reached its maximum duration")

            with pytest.raises(httpx.RemoteProtocolError):
                await stream_into(client, body("mp3"), chunks, lambda: server.call(end_the_session))
            assert chunks
        await wait_until_no_sessions(server)


async def test_a_client_that_stops_reading_is_dropped_at_the_stall_timeout_and_frees_its_slot() -> None:
    settings = Settings(engine="synthetic", max_sessions=1, stall_timeout_s=0.5)
    with serve(settings) as server:
        request = json.dumps(body()).encode()
        head = f"POST {SPEECH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(request)}\r\n\r\n"
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # stops reading: felt at once
        stalled.connect((server.host, server.port))
        stalled.sendall(head.encode() + request)
        try:
            async with httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client:
                # The one slot is held until the stalled client is dropped; then it is free again.
                await wait_for_sessions(server, 1)
                await wait_until_no_sessions(server)
                short = {**body(), "input": "My turn."}
                response = await client.post(SPEECH, json=short)
                assert response.status_code == 200 and len(response.content) > 0
        finally:
            stalled.close()


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
async def test_clients_that_disconnect_while_their_audio_is_encoded_cost_nothing(fmt: str) -> None:
    with serve(Settings(engine="synthetic")) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=LIMIT_S) as client:
            for _ in range(25):
                async with client.stream("POST", SPEECH, json=body(fmt)) as response:
                    assert response.status_code == 200
                    async for _chunk in response.aiter_raw():
                        break  # and the connection is dropped mid-stream
            await wait_until_no_sessions(server)
            response = await client.post(SPEECH, json={**body(fmt), "input": "Still here."})
            assert response.status_code == 200 and len(response.content) > 0
        pool = server.gateway.pool
        assert pool is not None and server.call(lambda: pool.active) == 0
