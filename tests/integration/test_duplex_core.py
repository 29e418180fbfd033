"""``omnigate serve --engine duplex --engine-process core``: the duplex engine's clock in the engine-core process,
its sessions served by the gateway over the core's socket. Real serve processes, real websocket clients (the
``openai`` SDK's realtime client); every wait is on a protocol event or on a state the server reports.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.integration.test_engine_core import CoreServer, core_server, read_until_dropped
from tests.integration.test_realtime_duplex import FRAME_BYTES, next_error, stream_audio
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until
from tests.unit.test_realtime_protocol import validate_server_event

pytestmark = pytest.mark.slow

DUPLEX = [
    *["--engine", "duplex", "--model", "preset:tiny", "-E", "device=cpu", "-E", "max_sessions=1"],
    *["-E", "retry_after_s=2", "--realtime-input-max-bytes", str(10 * FRAME_BYTES)],
    *["--max-sessions", "2"],  # the server admits two sessions: the duplex engine's one slot refuses the second
]


@dataclass
class Urls:
    """What the realtime client helper needs of a server."""

    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


async def metric(server: CoreServer, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} is not on /metrics"
    return float(found.group(1))


async def wait_metric(server: CoreServer, name: str, accept: Callable[[float], bool]) -> float:
    """Poll /metrics until ``accept(value)`` holds: the server's own state, not a guess about time."""
    async with asyncio.timeout(30):
        while True:
            value = await metric(server, name)
            if accept(value):
                return value
            await asyncio.sleep(0.05)


async def refusal_of(port: int) -> dict[str, object]:
    async with ws_connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        refusal: dict[str, object] = json.loads(await ws.recv())
        validate_server_event(refusal)
        await ws.wait_closed()
    return refusal


async def test_duplex_sessions_run_on_the_engine_core(tmp_path: Path) -> None:
    async with core_server(tmp_path, DUPLEX) as server:
        urls = Urls(server.port)
        async with realtime(urls) as connection:
            created = await recv(connection)
            assert created["session"]["capabilities"]["native_duplex"]
            sender = asyncio.create_task(stream_audio(connection, 40))
            try:
                # The model's response audio arrives from the core, in whole 80 ms frames.
                opened = await until(connection, "response.content_part.added")
                response_id = opened[-1]["response_id"]
                audio = await until(connection, "response.output_audio.delta")
                while len(pcm_of(audio, response_id)) < 3 * FRAME_BYTES:
                    audio.append(await recv(connection))
                assert len(pcm_of(audio, response_id)) % FRAME_BYTES == 0
                # The core's clock counters reach the gateway's /metrics.
                ticks = await wait_metric(server, 'omnigate_duplex_ticks_total{mode="eager"}', lambda v: v >= 3)
                assert ticks >= 3 and await metric(server, "omnigate_duplex_frames_total") >= 3
                assert await metric(server, "omnigate_duplex_step_seconds_count") >= 3
                assert await metric(server, "omnigate_duplex_sessions") == 1
                # The one slot is taken: a second session is refused, typed, with a retry hint.
                refusal = await refusal_of(server.port)
                error = refusal["error"]
                assert isinstance(error, dict) and error["code"] == "resource_exhausted"
                assert "retry after 2s" in error["message"]
            finally:
                sender.cancel()
        # The client left: its slot is free again (in the gateway's mirror, and in the core, which handles the
        # close before the next open), and a new session is admitted.
        await wait_metric(server, "omnigate_duplex_sessions", lambda v: v == 0)
        async with realtime(urls) as connection:
            assert (await recv(connection))["session"]["capabilities"]["native_duplex"]
            full = base64.b64encode(bytes(10 * FRAME_BYTES)).decode()  # the whole input cap at once
            await connection.send({"type": "input_audio_buffer.append", "event_id": "a1", "audio": full})
            await connection.send({"type": "input_audio_buffer.append", "event_id": "a2", "audio": full})
            error = (await next_error(connection))["error"]
            assert error["code"] == "input_backpressure" and error["event_id"] == "a2"
        await wait_metric(server, "omnigate_duplex_sessions", lambda v: v == 0)
        # SIGTERM drains the gateway, then ends the core: serve exits cleanly, the gateway never lost its core.
        server.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            assert await server.process.wait() == 0
        assert "lost their engine core" not in server.log.read_text()


async def test_a_killed_core_ends_duplex_sessions_typed_and_they_return_with_it(tmp_path: Path) -> None:
    async with core_server(tmp_path, DUPLEX) as server:
        urls = Urls(server.port)
        (core_pid,) = server.pids("engine core")
        async with realtime(urls) as connection:
            await recv(connection)
            sender = asyncio.create_task(stream_audio(connection, 400))
            try:
                await until(connection, "response.output_audio.delta")
                # The supervisor must not restart the core before the refusal below is seen.
                os.kill(server.process.pid, signal.SIGSTOP)
                try:
                    os.kill(core_pid, signal.SIGKILL)
                    error = (await next_error(connection))["error"]
                    assert error["code"] == "engine_unavailable"
                    refusal = await refusal_of(server.port)
                    refused = refusal["error"]
                    assert isinstance(refused, dict) and refused["code"] == "engine_unavailable"
                    assert (await server.wait_ready(503))["status"] == "engine_unhealthy"
                finally:
                    os.kill(server.process.pid, signal.SIGCONT)
            finally:
                sender.cancel()
        await server.wait_ready(200)
        assert len(server.pids("engine core")) == 2
        # The gateway's duplex connection reattaches on its own poll (/ready follows the pool's): until then new
        # sessions are refused, typed; then one is admitted.
        async with asyncio.timeout(60):
            while True:
                if await refusal_or_session(server.port) == "session.created":
                    break
                await asyncio.sleep(0.1)


async def refusal_or_session(port: int) -> str:
    """``session.created`` when a duplex session is admitted, else the refusal's code."""
    async with ws_connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        event = json.loads(await ws.recv())
        validate_server_event(event)
    if event["type"] == "session.created":
        return "session.created"
    code: str = event["error"]["code"]
    assert code == "engine_unavailable"
    return code


async def served_or_refused(urls: Urls) -> str:
    """A new duplex session that streams microphone audio: ``served`` at its first reply audio, else the code of
    the error that ended it (the core refusing a slot it still holds)."""
    async with realtime(urls) as connection:
        assert (await recv(connection))["type"] == "session.created"
        sender = asyncio.create_task(stream_audio(connection, 400))
        try:
            while True:
                event = await recv(connection)
                if event["type"] == "response.output_audio.delta":
                    return "served"
                if event["type"] == "error":
                    code: str = event["error"]["code"]
                    return code
        finally:
            sender.cancel()


async def test_a_killed_gateway_frees_its_duplex_slot_in_the_core(tmp_path: Path) -> None:
    async with core_server(tmp_path, DUPLEX) as server:
        urls = Urls(server.port)
        (worker_pid,) = server.pids("gateway worker 0")
        held = await ws_connect(f"ws://127.0.0.1:{server.port}/v1/duplex")
        assert json.loads(await held.recv())["type"] == "session.created"
        await wait_metric(server, "omnigate_duplex_sessions", lambda v: v == 1)
        os.kill(worker_pid, signal.SIGKILL)
        await read_until_dropped(held)
        await server.wait_ready(200)
        assert len(server.pids("gateway worker 0")) == 2
        # The restarted gateway knows no session; the core closed the dead one's with its connection, so the
        # one slot serves a new session (were it still held, the core would refuse it: resource_exhausted).
        async with asyncio.timeout(60):
            while True:
                outcome = await served_or_refused(urls)
                if outcome == "served":
                    break
                assert outcome == "resource_exhausted"
