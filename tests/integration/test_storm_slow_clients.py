"""Slow and stalled clients beside normal ones: the server holds no more for them than their outbox allows, stops
generating for them, and the normal sessions get all their audio.

What slow clients do to the others' TTFA and underruns is a timing question, measured by
``benchmarks/slow_clients.py`` with the load-test CLI (results in ``docs/reliability/``), not asserted here.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.settings import Settings
from omnigate.sessions.driver import SessionDriver
from tests.audio_checks import synthetic_ms
from tests.integration.ws_client import collect_utterance, next_json, send
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.slow

STREAM = "/v1/audio/speech/stream"
# Six minutes of synthetic audio: far more than any socket or outbox holds.
LONG_TEXT = "Slow clients must not cost the others anything. " * 120
SHORT_TEXT = "A normal client speaks and listens."
SAMPLE_RATE = 24_000


def small_socket(server: RunningServer) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    return sock


async def start_long_utterance(server: RunningServer) -> ClientConnection:
    ws = await connect(server.ws_url + STREAM, sock=small_socket(server), max_queue=1)
    await send(ws, "session.config", response_format="pcm", stream_audio=True)
    await send(ws, "input.text", text=LONG_TEXT)
    await send(ws, "input.done")
    assert (await next_json(ws))["type"] == "audio.start"
    return ws


async def read_at_half_speed(ws: ClientConnection) -> None:
    """Consume audio at half real time: after each chunk, wait twice its duration (the pacing under test)."""
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            await asyncio.sleep(2 * len(message) / 2 / SAMPLE_RATE)
        elif json.loads(message)["type"] == "session.done":
            return


def new_driver(server: RunningServer, known: set[int]) -> SessionDriver | None:
    for lease in server.gateway.registry.leases:
        if lease.driver is not None and id(lease.driver) not in known:
            return lease.driver
    return None


async def driver_of_next_session(server: RunningServer, known: set[int]) -> SessionDriver:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while (driver := server.call(lambda: new_driver(server, known))) is None:
        assert loop.time() < deadline, "the session never registered"
        await asyncio.sleep(0.02)
    assert isinstance(driver, SessionDriver)
    known.add(id(driver))
    return driver


def held(server: RunningServer, driver: SessionDriver) -> tuple[float, int, float, float]:
    """Media and bytes the server holds for a session, and what it generated and delivered."""
    result = server.call(
        lambda: (driver.outbox.media_ms, driver.outbox.bytes, driver.generated_ms, driver.delivered_ms)
    )
    assert isinstance(result, tuple)
    return result


async def test_slow_and_stalled_clients_cost_only_their_outbox() -> None:
    settings = Settings(engine="synthetic", stall_timeout_s=3600.0, max_utterance_audio_s=600.0)
    with serve(settings) as server:
        known: set[int] = set()
        stalled = await start_long_utterance(server)
        stalled_driver = await driver_of_next_session(server, known)
        slow = await start_long_utterance(server)
        slow_driver = await driver_of_next_session(server, known)
        slow_reader = asyncio.create_task(read_at_half_speed(slow))

        # Normal sessions, one after another beside them, each get every byte of their audio.
        for _ in range(6):
            async with connect(server.ws_url + STREAM) as ws:
                await send(ws, "session.config", response_format="pcm", stream_audio=True)
                await send(ws, "input.text", text=SHORT_TEXT)
                await send(ws, "input.done")
                utt = await collect_utterance(ws)
            assert utt.end is not None and utt.end["status"] == "completed"
            assert len(utt.pcm) == round(synthetic_ms(SHORT_TEXT) / 1000 * SAMPLE_RATE) * 2
            for driver in (stalled_driver, slow_driver):
                media_ms, nbytes, generated, delivered = held(server, driver)
                assert media_ms <= settings.ws_outbox_ms + 100.0 and nbytes <= settings.outbox_bytes
                assert generated == pytest.approx(delivered + media_ms)

        # Neither slow session ran ahead of its client: most of the utterance was never generated.
        total_ms = synthetic_ms(LONG_TEXT)
        for driver in (stalled_driver, slow_driver):
            _, _, generated, _ = held(server, driver)
            assert generated < 0.5 * total_ms

        slow_reader.cancel()
        await asyncio.gather(slow_reader, return_exceptions=True)
        stalled.transport.abort()
        slow.transport.abort()
