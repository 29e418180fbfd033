"""The supervisor of ``omnigate serve --engine-process core`` restarts a child however many times it dies, and ends
serve with status 1 on a child that cannot stay up: the real CLI in a subprocess, real clients, ``kill -9``.

Every wait is on a state the server reports (its log, ``/ready``, a served utterance); none is on time alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.test_drain import free_port
from tests.integration.test_engine_core import SENTENCE, CoreServer, core_server, pcm_bytes, speak

pytestmark = pytest.mark.slow

KILLS = 3


async def wait_logged(server: CoreServer, text: str, count: int) -> None:
    """Wait until the serve log holds ``text`` ``count`` times (the supervisor logs every start and exit)."""
    async with asyncio.timeout(60):
        while server.log.read_text().count(text) < count:
            assert server.process.returncode is None, server.log.read_text()
            await asyncio.sleep(0.05)


async def speak_once_served(server: CoreServer) -> None:
    """Speak until an utterance completes. A worker that has not yet noticed the new core refuses (or fails) the
    attempt with ``engine_unavailable`` and reconnects; nothing else is accepted."""
    async with asyncio.timeout(60):
        while True:
            received, events = await speak(server.url, SENTENCE)
            if events[-1]["status"] == "completed":
                assert received == pcm_bytes(SENTENCE)
                return
            errors = [e for e in events if e["type"] == "error"]
            assert errors and all(e["code"] == "engine_unavailable" for e in errors), events


async def test_the_engine_core_killed_three_times_is_restarted_each_time(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--workers", "2", "--model", "rtf=0.2"]) as server:
        await server.wait_workers_started(2)
        for kill in range(1, KILLS + 1):
            os.kill(server.pids("engine core")[-1], signal.SIGKILL)
            await wait_logged(server, "engine core exited with -9", kill)
            await wait_logged(server, "engine core started: pid", kill + 1)
            await server.wait_ready(200)
            await speak_once_served(server)
        assert len(set(server.pids("engine core"))) == KILLS + 1
        assert server.pids("gateway worker 0") == server.pids("gateway worker 0")[:1]  # the workers lived on


async def test_a_gateway_worker_killed_three_times_is_restarted_each_time(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--workers", "2", "--model", "rtf=0.2"]) as server:
        await server.wait_workers_started(2)
        for kill in range(1, KILLS + 1):
            os.kill(server.pids("gateway worker 0")[-1], signal.SIGKILL)
            await wait_logged(server, "gateway worker 0 exited with -9", kill)
            await server.wait_workers_started(2 + kill)  # the new worker 0 has bound the port
            await server.wait_ready(200)
            results = await asyncio.gather(*(speak(server.url, SENTENCE) for _ in range(4)))
            assert [events[-1]["status"] for _, events in results] == ["completed"] * 4
        assert len(set(server.pids("gateway worker 0"))) == KILLS + 1
        assert len(server.pids("engine core")) == 1


async def test_an_engine_core_that_cannot_start_ends_serve_with_status_1(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine", "synthetic"],
            *["--port", str(free_port()), "--engine-process", "core", "--workers", "1"],
            *["-E", "no_such_option=1"],  # the engine refuses it: every core exits at start
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        async with asyncio.timeout(120):
            assert await process.wait() == 1
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = log.read_text()
    assert text.count("engine core started: pid") == 5
    for failure in range(1, 5):
        assert f"engine core exited with 1 (failure {failure} in a row); restarting" in text
    assert "engine core exited with 1: 5 failures in a row, each within 30 s of its start" in text
    assert "stopping serve (status 1)" in text
