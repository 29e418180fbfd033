"""``omnigate serve --engine-process core --workers 2``: the engine core admits speech sessions itself, so a burst of
connections spread over both gateway workers gets exactly the engine's room: every admitted session is served to
the end, every other connection is refused at once with the typed ``engine_busy`` and a retry hint; and the core's
steps reach the workers' ``/metrics``. Real serve
processes, real websocket clients; which worker a connection lands on is the kernel's choice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.integration.test_duplex_core import wait_metric
from tests.integration.test_duplex_workers import both_workers_serve
from tests.integration.test_engine_core import LIMIT_S, SENTENCE, STREAM, core_server, pcm_bytes, speak
from tests.integration.ws_client import send

pytestmark = pytest.mark.slow

SLOTS = 3
BURST = 10  # more than the slots, at once: both workers admit at the same time
WORKERS = [
    *["--model", "rtf=0.2", "-E", f"max_sessions={SLOTS}"],
    *["--workers", "2", "--max-sessions", "16"],  # each worker's registry admits more than the engine's room
]


async def speak_on(ws: ClientConnection) -> tuple[int, list[dict[str, Any]], int | None]:
    """One utterance on ``ws``: the PCM bytes, every JSON event up to ``session.done`` (or the close), and the
    close code if the server closed the connection."""
    with contextlib.suppress(ConnectionClosed):  # a refused connection is closed already
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text=SENTENCE)
        await send(ws, "input.done")
    received, events = 0, []
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(LIMIT_S):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    received += len(message)
                    continue
                events.append(json.loads(message))
                if events[-1]["type"] == "session.done":
                    return received, events, None
    closed = ws.protocol.close_rcvd
    assert closed is not None, "closed without a close frame"
    return received, events, closed.code


def assert_refused(outcome: tuple[int, list[dict[str, Any]], int | None]) -> None:
    received, events, code = outcome
    assert received == 0 and code == 1013, outcome
    assert [e["type"] for e in events] == ["error"], events
    error = events[0]
    assert error["code"] == "engine_busy" and error["retry_after"] == 1.0, error


async def test_a_burst_over_two_workers_admits_exactly_the_engines_room(tmp_path: Path) -> None:
    async with core_server(tmp_path, WORKERS) as server:
        await both_workers_serve(server)
        async with contextlib.AsyncExitStack() as stack:
            url = f"ws://127.0.0.1:{server.port}{STREAM}"
            sockets = await asyncio.gather(*(stack.enter_async_context(connect(url)) for _ in range(BURST)))
            outcomes = await asyncio.gather(*(speak_on(ws) for ws in sockets))
            admitted = [ws for ws, (_, _, code) in zip(sockets, outcomes, strict=True) if code is None]
            assert len(admitted) == SLOTS  # exactly the room, though both workers admitted at once
            for ws, outcome in zip(sockets, outcomes, strict=True):
                if ws in admitted:
                    received, events, _ = outcome  # served to the end: admitted, never starved
                    assert received == pcm_bytes(SENTENCE)
                    assert not [e for e in events if e["type"] == "error"]
                    assert events[-1]["status"] == "completed"
                else:
                    assert_refused(outcome)
            # The admitted sessions hold their places between utterances; one leaves, and its place is free once
            # its worker's close reached the core: a new session takes it, and the next is refused again.
            await admitted[0].close()
            async with asyncio.timeout(LIMIT_S):
                while True:
                    ws = await stack.enter_async_context(connect(url))
                    outcome = await speak_on(ws)
                    if outcome[2] is None:
                        assert outcome[0] == pcm_bytes(SENTENCE)
                        break
                    assert_refused(outcome)
            assert_refused(await speak_on(await stack.enter_async_context(connect(url))))


async def test_the_cores_steps_reach_the_workers_metrics(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--model", "rtf=0.2"]) as server:
        received, _ = await speak(server.url, SENTENCE)
        assert received == pcm_bytes(SENTENCE)
        # The core's steps reach each worker's /metrics as the in-process pool's do: the step-time and batch
        # histograms, and the engine's busy fraction.
        await wait_metric(server, "omnigate_engine_step_duration_seconds_count", lambda steps: steps > 0)
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).text
        assert re.search(r'^omnigate_engine_step_duration_seconds_bucket\{le="0.05"\} ', metrics, re.MULTILINE)
        assert re.search(r"^omnigate_engine_batch_size_sum [1-9]", metrics, re.MULTILINE)
        busy = re.search(r"^omnigate_engine_busy_fraction (\S+)", metrics, re.MULTILINE)
        assert busy is not None and 0.0 <= float(busy.group(1)) <= 1.0
