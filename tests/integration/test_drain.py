"""Graceful drain of a real ``omnigate serve`` process on SIGTERM, with live sessions.

The server runs as a subprocess so the signal, the drain and the exit status are the real ones. The synthetic engine
generates at real time (``rtf=1``), so an utterance is still speaking when the signal arrives; every step of the test
waits on protocol events, never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
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
from tests.integration.ws_client import send

pytestmark = pytest.mark.slow

STREAM = "/v1/audio/speech/stream"
READ_LIMIT_S = 30.0
# About 3 s of synthetic audio at 60 ms per character.
SPOKEN = "The drain lets this sentence finish before the process exits."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    def __init__(self, process: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{STREAM}"

    async def ready(self) -> tuple[int, str]:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{self.port}/ready")
        return r.status_code, r.json()["status"]

    async def exit_code(self) -> int:
        async with asyncio.timeout(READ_LIMIT_S):
            return await self.process.wait()


@asynccontextmanager
async def server_process(
    tmp_path: Path, drain_timeout_s: float, extra_args: Sequence[str] = ()
) -> AsyncIterator[ServerProcess]:
    """``omnigate serve`` with the synthetic engine at real time, plus ``extra_args``; killed on the way out."""
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *[
                sys.executable,
                "-m",
                "omnigate.gateway.cli",
                "serve",
                "--engine",
                "synthetic",
                "--model",
                "rtf=1.0",
                "--port",
                str(port),
                "--drain-timeout",
                str(drain_timeout_s),
                *extra_args,
            ],
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(process, port, log)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60.0
        while True:
            try:
                if (await server.ready())[0] == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.returncode is None, log.read_text()
            assert loop.time() < deadline, "the server did not become ready"
            await asyncio.sleep(0.05)
        yield server
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def next_event(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(READ_LIMIT_S):
        while True:
            message = await ws.recv()
            if isinstance(message, str):
                event: dict[str, Any] = json.loads(message)
                return event


async def close_code(ws: ClientConnection) -> int:
    """Read until the server closes; the close code it sent."""
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(READ_LIMIT_S):
            async for _ in ws:
                pass
    received = ws.protocol.close_rcvd
    assert received is not None, "closed without a close frame"
    return received.code


async def start_speaking(server: ServerProcess, text: str) -> ClientConnection:
    ws = await connect(server.url)
    await send(ws, "session.config", response_format="pcm", stream_audio=True)
    await send(ws, "input.text", text=text)
    await send(ws, "input.done")
    assert (await next_event(ws))["type"] == "audio.start"
    return ws


async def test_sigterm_lets_live_utterances_finish_then_exits_zero(tmp_path: Path) -> None:
    async with server_process(tmp_path, drain_timeout_s=30.0) as server:
        idle = await connect(server.url)
        await send(idle, "session.config", response_format="pcm")
        speaking = await start_speaking(server, SPOKEN)
        received = 0

        server.process.send_signal(signal.SIGTERM)

        # The idle session is closed at once, typed.
        error = await next_event(idle)
        assert error["type"] == "error" and error["code"] == "shutting_down"
        assert await close_code(idle) == 1012
        # New sessions are refused, typed, and the process reports it is draining.
        refused = await connect(server.url)
        assert (await next_event(refused))["code"] == "shutting_down"
        assert await close_code(refused) == 1012
        assert await server.ready() == (503, "draining")

        # The live utterance finishes with all its audio, then its session is closed.
        async with asyncio.timeout(READ_LIMIT_S):
            while True:
                message = await speaking.recv()
                if isinstance(message, bytes):
                    received += len(message)
                elif json.loads(message)["type"] == "session.done":
                    assert json.loads(message)["status"] == "completed"
                    break
        assert received == round(synthetic_ms(SPOKEN) / 1000 * 24_000) * 2
        assert (await next_event(speaking))["code"] == "shutting_down"
        assert await close_code(speaking) == 1012

        assert await server.exit_code() == 0
        log = server.log.read_text()
        assert "drain finished" in log and "1 at the deadline" not in log


async def test_sessions_still_speaking_at_the_deadline_are_closed_typed(tmp_path: Path) -> None:
    async with server_process(tmp_path, drain_timeout_s=0.5) as server:
        # A minute of audio: far longer than the drain deadline.
        speaking = await start_speaking(server, "Speaking for a very long time. " * 35)
        server.process.send_signal(signal.SIGTERM)
        events = []
        while (event := await next_event(speaking))["type"] != "error":
            events.append(event["type"])
        assert event["code"] == "shutting_down"
        assert await close_code(speaking) == 1012
        assert await server.exit_code() == 0
        assert "1 at the deadline" in server.log.read_text()
