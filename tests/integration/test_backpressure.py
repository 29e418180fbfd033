"""Backpressure, stalls, disconnects and admission against the real server.

Assertions are on audio generated and on resources held, never on elapsed time. Where the test must wait for the
server to reach a state (the engine parked for lack of credit, a session torn down), it polls that state with a
deadline: the deadline only bounds a failing run.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from omnigate.engines.pool import EnginePool
from omnigate.gateway.settings import Settings
from omnigate.sessions.driver import SessionDriver
from tests.audio_checks import synthetic_ms
from tests.integration.ws_client import collect_utterance, next_json, send
from tests.serving import RunningServer, serve

STREAM = "/v1/audio/speech/stream"
# 60 ms of synthetic audio per character: 6000 characters are six minutes of audio, far more than any socket holds.
LONG_TEXT = "Backpressure keeps memory bounded. " * 170


async def wait_until(server: RunningServer, predicate: Callable[[], bool], limit_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not server.call(predicate):
        if loop.time() > deadline:
            raise AssertionError("the server never reached the expected state")
        await asyncio.sleep(0.02)


def small_socket(server: RunningServer) -> socket.socket:
    """A client socket with a tiny receive buffer, so a client that stops reading is felt at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    return sock


def only_driver(server: RunningServer) -> SessionDriver:
    [lease] = server.gateway.registry.leases
    assert lease.driver is not None
    return lease.driver


def pool(server: RunningServer) -> EnginePool:
    assert server.gateway.pool is not None
    return server.gateway.pool


@pytest.fixture
def stall_server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", stall_timeout_s=3600.0, max_utterance_audio_s=600.0)) as server:
        yield server


async def test_a_client_that_stops_reading_stops_its_own_generation(stall_server: RunningServer) -> None:
    server = stall_server
    async with connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as ws:
        await send(ws, "session.config", response_format="pcm", stream_audio=True)
        await send(ws, "input.text", text=LONG_TEXT)
        await send(ws, "input.done")
        assert (await next_json(ws))["type"] == "audio.start"

        # The client reads nothing more. The engine must park this stream for lack of credit.
        def parked() -> bool:
            d = only_driver(server)
            streams = list(d._streams.values())
            return bool(streams) and not streams[0].busy and streams[0].credit_ms <= 0.0

        await wait_until(server, parked)
        driver: SessionDriver = server.call(lambda: only_driver(server))  # type: ignore[assignment]
        generated, delivered, held = server.call(
            lambda: (driver.generated_ms, driver.delivered_ms, driver.outbox.media_ms)
        )  # type: ignore[misc]
        total_ms = synthetic_ms(LONG_TEXT)
        assert generated < 0.5 * total_ms, "the engine kept generating for a client that reads nothing"
        # What the server holds for this client is within the outbox bound...
        assert held <= server.gateway.settings.ws_outbox_ms + 100.0
        # ...and everything generated is either held or was handed to the transport.
        assert generated == pytest.approx(delivered + held)

        # Reading again resumes generation, and every byte arrives.
        utt = await collect_utterance(ws)
    assert utt.end is not None and utt.end["status"] == "completed"
    assert len(utt.pcm) == round(total_ms / 1000 * 24000) * 2


async def test_a_stalled_client_is_closed_after_the_stall_timeout_and_everything_is_released() -> None:
    with serve(Settings(engine="synthetic", stall_timeout_s=0.5)) as server:
        async with connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1) as ws:
            await send(ws, "session.config", response_format="pcm", stream_audio=True)
            await send(ws, "input.text", text=LONG_TEXT)
            await send(ws, "input.done")
            await wait_until(server, lambda: server.gateway.registry.total_active == 0)
            await wait_until(server, lambda: pool(server).active == 0)
            assert pool(server).aborted_total == 1


async def test_disconnect_mid_utterance_aborts_engine_work_and_releases_the_session(
    synthetic_server: RunningServer,
) -> None:
    server = synthetic_server
    aborted_before = pool(server).aborted_total
    ws = await connect(server.ws_url + STREAM)
    await send(ws, "session.config", response_format="pcm", stream_audio=True)
    await send(ws, "input.text", text=LONG_TEXT)
    await send(ws, "input.done")
    assert (await next_json(ws))["type"] == "audio.start"
    assert isinstance(await ws.recv(), bytes)
    ws.transport.abort()  # vanish mid-stream, no closing handshake
    await wait_until(server, lambda: server.gateway.registry.total_active == 0)
    await wait_until(server, lambda: pool(server).active == 0)
    assert pool(server).aborted_total == aborted_before + 1
    assert server.gateway.registry.leases == set()


async def test_sessions_over_the_cap_are_refused_fast_and_typed() -> None:
    with serve(Settings(engine="synthetic", max_sessions=1)) as server:
        async with connect(server.ws_url + STREAM) as first:
            await send(first, "session.config", response_format="pcm")
            async with connect(server.ws_url + STREAM) as second:
                error = await next_json(second)
                assert error["code"] == "server_busy" and error["retry_after"] > 0
                with pytest.raises(ConnectionClosed) as closed:
                    await second.recv()
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
            async with httpx.AsyncClient(base_url=server.http_url) as client:
                r = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "alloy"})
            assert r.status_code == 503 and "retry-after" in r.headers
            assert r.json()["error"]["code"] == "server_busy"
            # The admitted session is unaffected.
            await send(first, "input.text", text="Still here.")
            await send(first, "input.done")
            utt = await collect_utterance(first)
            assert utt.end is not None and utt.end["status"] == "completed"


async def test_idle_session_is_closed_with_a_typed_reason() -> None:
    # Each short timer runs out while the client sends nothing, so no message of the client races it (the idle
    # timeout between utterances is tested on the session itself).
    with serve(Settings(engine="synthetic", config_timeout_s=0.3)) as server:
        async with connect(server.ws_url + STREAM) as ws:
            error = await next_json(ws)
            assert error["code"] == "config_timeout"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
    with serve(Settings(engine="synthetic", idle_timeout_s=0.6)) as server:
        async with connect(server.ws_url + STREAM) as ws:
            await send(ws, "session.config", response_format="pcm")
            error = await next_json(ws)
            assert error["code"] == "idle_timeout"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
        await wait_until(server, lambda: server.gateway.registry.total_active == 0)


async def test_http_client_disconnect_aborts_generation(synthetic_server: RunningServer) -> None:
    server = synthetic_server
    aborted_before = pool(server).aborted_total
    async with (
        httpx.AsyncClient(base_url=server.http_url) as client,
        client.stream(
            "POST",
            "/v1/audio/speech",
            json={
                "model": "tts-1",
                "input": LONG_TEXT[:4000],
                "voice": "alloy",
                "response_format": "pcm",
            },
        ) as response,
    ):
        async for _ in response.aiter_bytes():
            break
    await wait_until(server, lambda: server.gateway.registry.total_active == 0)
    await wait_until(server, lambda: pool(server).active == 0)
    assert pool(server).aborted_total == aborted_before + 1
