"""``omnigate serve --engine duplex --engine-process core --workers 2``: two gateway processes share the port and
one duplex engine core, whose slots admit every worker's sessions exactly. Real serve processes, real websocket
clients; which worker a connection lands on is the kernel's choice, so every assertion holds for either."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from tests.integration.test_duplex_core import wait_metric
from tests.integration.test_engine_core import CoreServer, core_server
from tests.integration.test_realtime_duplex import FRAME_BYTES
from tests.unit.test_realtime_protocol import validate_server_event

pytestmark = pytest.mark.slow

SLOTS = 2
ATTEMPTS = 6  # more than the slots, over fresh connections: both workers are asked (the kernel spreads them)
WORKERS = [
    *["--engine", "duplex", "--model", "preset:tiny", "-E", "device=cpu", "-E", f"max_sessions={SLOTS}"],
    *["-E", "retry_after_s=2", "--realtime-input-max-bytes", str(10 * FRAME_BYTES)],
    *["--workers", "2", "--max-sessions", "8"],  # each worker's registry admits more than the engine's slots
]


async def first_event(ws: ClientConnection) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await ws.recv())
    validate_server_event(event)
    return event


async def attempt(server: CoreServer, stack: contextlib.AsyncExitStack) -> tuple[ClientConnection, dict[str, Any]]:
    """A new duplex session, kept open by ``stack``: its connection and its first event."""
    ws = await stack.enter_async_context(ws_connect(f"ws://127.0.0.1:{server.port}/v1/duplex"))
    return ws, await first_event(ws)


def assert_full(event: dict[str, Any]) -> None:
    assert event["type"] == "error", event
    assert event["error"]["code"] == "resource_exhausted"
    assert "retry after 2s" in event["error"]["message"]


async def both_workers_serve(server: CoreServer) -> None:
    """Until both gateway workers have attached to the core and listen (each logs its startup)."""
    async with asyncio.timeout(60):
        while True:
            if server.log.read_text().count("Application startup complete") >= 2:
                return
            await asyncio.sleep(0.1)


async def audio_flows(ws: ClientConnection) -> None:
    """Microphone audio in, the model's audio out, in whole frames."""
    chunk = base64.b64encode(b"\x20\x00" * (24 * 80)).decode()
    async with asyncio.timeout(60):
        while True:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.08):  # a real-time client's pace: one frame per 80 ms
                    while True:
                        event = json.loads(await ws.recv())
                        if event["type"] == "response.output_audio.delta":
                            assert len(base64.b64decode(event["delta"])) % FRAME_BYTES == 0
                            return
                        assert event["type"] != "error", event


async def test_two_gateway_workers_share_the_duplex_slots_exactly(tmp_path: Path) -> None:
    async with core_server(tmp_path, WORKERS) as server:
        assert len(server.pids("gateway worker 0")) == len(server.pids("gateway worker 1")) == 1
        await both_workers_serve(server)
        async with contextlib.AsyncExitStack() as stack:
            outcomes = [await attempt(server, stack) for _ in range(ATTEMPTS)]
            admitted = [ws for ws, event in outcomes if event["type"] == "session.created"]
            assert len(admitted) == SLOTS  # never more than the engine's slots, never fewer while one is free
            for _, event in outcomes:
                if event["type"] != "session.created":
                    assert_full(event)
            await audio_flows(admitted[0])
            # One session leaves: its slot is free once its worker's close reached the core (closes and opens from
            # different workers cross on different connections), and a new session takes it.
            await admitted[1].close()
            async with asyncio.timeout(60):
                while True:
                    ws, event = await attempt(server, stack)
                    if event["type"] == "session.created":
                        break
                    assert_full(event)
            await audio_flows(ws)
            _, event = await attempt(server, stack)
            assert_full(event)  # full again, whichever worker asks
        await wait_metric(server, "omnigate_duplex_sessions", lambda v: v == 0)
