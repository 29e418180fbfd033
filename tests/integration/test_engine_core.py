"""``omnigate serve --engine-process core``: real serve processes (supervisor, engine core, gateway workers) and
real clients, including a killed engine core, a killed gateway worker, two workers and the drain.

Every wait is on a protocol event or on a state the server reports (``/ready``); none is on time alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.audio_checks import synthetic_ms
from tests.integration.test_drain import close_code, free_port, next_event
from tests.integration.ws_client import send

pytestmark = pytest.mark.slow

STREAM = "/v1/audio/speech/stream"
LIMIT_S = 30.0
SENTENCE = "The engine core speaks this sentence through the gateway."


class CoreServer:
    def __init__(self, process: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{STREAM}"

    def pids(self, name: str) -> list[int]:
        """Pids of the supervisor's children called ``name`` ("engine core", "gateway worker 0"), oldest first."""
        pattern = re.compile(rf"{re.escape(name)} started: pid (\d+)")
        return [int(m.group(1)) for m in pattern.finditer(self.log.read_text())]

    async def ready(self) -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{self.port}/ready")
        return r.status_code, r.json()

    async def wait_workers_started(self, workers: int) -> None:
        """Wait until every gateway worker has finished its startup (each logs it): a signal that reaches a worker
        still starting is not the drain under test."""
        async with asyncio.timeout(60):
            while self.log.read_text().count("Application startup complete") < workers:
                assert self.process.returncode is None, self.log.read_text()
                await asyncio.sleep(0.05)

    async def wait_ready(self, status: int, free_slots: int | None = None) -> dict[str, Any]:
        """Poll /ready until it answers ``status`` (and, when given, ``free_slots`` engine slots free): the state
        is the server's, not a guess about time."""
        async with asyncio.timeout(60):
            while True:
                try:
                    code, body = await self.ready()
                    if code == status and free_slots in (None, body.get("engine_free_slots")):
                        return body
                except httpx.TransportError:
                    pass
                assert self.process.returncode is None, self.log.read_text()
                await asyncio.sleep(0.05)


@asynccontextmanager
async def core_server(tmp_path: Path, args: Sequence[str]) -> AsyncIterator[CoreServer]:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine", "synthetic", "--port", str(port)],
            *["--engine-process", "core", "--admission", "slots", *args],
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = CoreServer(process, port, log)
    try:
        await server.wait_ready(200)
        yield server
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(LIMIT_S):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


async def speak(url: str, text: str) -> tuple[int, list[dict[str, Any]]]:
    """One utterance on a new session: the PCM bytes received and every JSON event up to ``session.done``."""
    async with connect(url) as ws:
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text=text)
        await send(ws, "input.done")
        return await read_to_done(ws)


async def read_to_done(ws: ClientConnection) -> tuple[int, list[dict[str, Any]]]:
    received, events = 0, []
    async with asyncio.timeout(LIMIT_S):
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                received += len(message)
                continue
            events.append(json.loads(message))
            if events[-1]["type"] == "session.done":
                return received, events


async def read_until_dropped(ws: ClientConnection) -> None:
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(_drain_messages(ws), LIMIT_S)


async def _drain_messages(ws: ClientConnection) -> None:
    async for _ in ws:
        pass


def pcm_bytes(text: str) -> int:
    return round(synthetic_ms(text) / 1000 * 24_000) * 2


async def test_two_workers_serve_every_stream_to_one_terminal(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--workers", "2", "--model", "rtf=0.2"]) as server:
        assert len(server.pids("gateway worker 0")) == 1 and len(server.pids("gateway worker 1")) == 1
        texts = [f"Session number {i} asks the shared engine core for audio." for i in range(12)]
        results = await asyncio.gather(*(speak(server.url, text) for text in texts))
        for text, (received, events) in zip(texts, results, strict=True):
            assert received == pcm_bytes(text)
            terminals = [e for e in events if e["type"] == "session.done"]
            assert [t["status"] for t in terminals] == ["completed"]
            assert not [e for e in events if e["type"] == "error"]
        # The pool gauges reach /ready and /metrics through the client: the core's slots, all free again.
        body = await server.wait_ready(200, free_slots=1000)
        assert body["sessions_max"] == 1000
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).text
        assert re.search(r"^omnigate_engine_free_slots \d+", metrics, re.MULTILINE)
        assert re.search(r'^omnigate_engine_steps_total\{engine="synthetic"\} [1-9]', metrics, re.MULTILINE)


async def test_a_killed_engine_core_fails_its_streams_typed_and_ready_waits_for_its_restart(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--model", "rtf=1.0"]) as server:
        (core_pid,) = server.pids("engine core")
        async with connect(server.url) as ws:
            await send(ws, "session.config", response_format="pcm")
            await send(ws, "input.text", text="Speaking for a very long time. " * 20)
            await send(ws, "input.done")
            assert (await next_event(ws))["type"] == "audio.start"
            # The supervisor must not restart the core before the gateway has been seen unready.
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                os.kill(core_pid, signal.SIGKILL)
                _, events = await read_to_done(ws)
                errors = [e for e in events if e["type"] == "error"]
                assert len(errors) == 1 and errors[0]["message"].startswith("engine_unavailable:")
                assert [e["status"] for e in events if e["type"] == "session.done"] == ["error"]
                body = await server.wait_ready(503)
                assert body["status"] == "engine_unhealthy"
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        await server.wait_ready(200)
        assert len(server.pids("engine core")) == 2
        received, events = await speak(server.url, SENTENCE)
        assert received == pcm_bytes(SENTENCE)
        assert events[-1]["status"] == "completed"


async def test_a_killed_gateway_frees_its_slots_in_the_core(tmp_path: Path) -> None:
    # Two slots, both held by one gateway's live utterances when it dies.
    async with core_server(tmp_path, ["--model", "rtf=1.0", "-E", "max_sessions=2"]) as server:
        (worker_pid,) = server.pids("gateway worker 0")
        held = []
        for _ in range(2):
            ws = await connect(server.url)
            await send(ws, "session.config", response_format="pcm")
            await send(ws, "input.text", text="Holding a slot for a long time. " * 20)
            await send(ws, "input.done")
            assert (await next_event(ws))["type"] == "audio.start"
            held.append(ws)
        _, body = await server.ready()
        assert body["engine_free_slots"] == 0
        os.kill(worker_pid, signal.SIGKILL)
        for ws in held:
            await read_until_dropped(ws)
            assert ws.protocol.close_rcvd is None  # the process died: no close frame
        await server.wait_ready(200, free_slots=2)  # the restarted worker sees the core's slots free again
        assert len(server.pids("gateway worker 0")) == 2
        results = await asyncio.gather(speak(server.url, SENTENCE), speak(server.url, SENTENCE))
        assert [events[-1]["status"] for _, events in results] == ["completed", "completed"]


async def test_sigterm_drains_every_worker_before_the_core_stops(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--workers", "2", "--model", "rtf=1.0", "--drain-timeout", "30"]) as server:
        await server.wait_workers_started(2)
        text = "The drain lets this sentence finish before the core stops."
        speaking = []
        for _ in range(4):
            ws = await connect(server.url)
            await send(ws, "session.config", response_format="pcm")
            await send(ws, "input.text", text=text)
            await send(ws, "input.done")
            assert (await next_event(ws))["type"] == "audio.start"
            speaking.append(ws)
        server.process.send_signal(signal.SIGTERM)
        for ws in speaking:
            received, events = await read_to_done(ws)
            assert events[-1]["status"] == "completed"
            # audio.start was read before; the rest of the utterance's audio arrived in full
            assert received == pcm_bytes(text)
            assert (await next_event(ws))["code"] == "shutting_down"
            assert await close_code(ws) == 1012
        async with asyncio.timeout(LIMIT_S):
            assert await server.process.wait() == 0
        log = server.log.read_text()
        assert log.count("drain finished") == 2
        assert "engine_unavailable" not in log
