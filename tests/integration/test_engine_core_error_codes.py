"""The typed codes a client gets when the engine core fails its stream, on every speech route of a real
``omnigate serve --engine-process core``: ``engine_unavailable`` when the core dies mid-utterance, ``engine_busy``
(with a retry hint) when the core refuses a stream its gateway worker admitted (the HTTP route; a speech stream
session holds a place the core granted it, so its utterances are not refused so). Never ``generation_failed``.

Every wait is on a protocol event or a state the server reports; the core and the worker are paused with SIGSTOP
where the test needs their order of events fixed, never by waiting for time to pass.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omnigate.engines.base import EngineOutput, StreamDone, SynthesisParams
from omnigate.engines.core.client import connect_core_pool
from omnigate.engines.pool import PoolFull
from tests.integration.test_drain import next_event
from tests.integration.test_engine_core import LIMIT_S, SENTENCE, CoreServer, core_server, read_to_done
from tests.integration.ws_client import send

pytestmark = pytest.mark.slow

LONG = "Speaking for a very long time. " * 20


def core_socket(core_pid: int) -> str:
    """The engine core's socket path, from its command line (``--socket PATH``)."""
    argv = Path(f"/proc/{core_pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--socket") + 1]


def realtime_speak(text: str) -> str:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return json.dumps({"type": "response.create", "response": {"input": [message]}})


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


async def collect(events: AsyncIterator[dict[str, Any]], into: list[dict[str, Any]]) -> None:
    async for event in events:
        into.append(event)


async def test_a_killed_core_ends_every_route_in_flight_with_engine_unavailable(tmp_path: Path) -> None:
    async with (
        core_server(tmp_path, ["--workers", "1", "--model", "rtf=1.0"]) as server,
        connect(server.url) as speech,
        connect(f"ws://127.0.0.1:{server.port}/v1/realtime", compression=None) as realtime,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=LIMIT_S) as http,
    ):
        await send(speech, "session.config", response_format="pcm")
        await send(speech, "input.text", text=LONG)
        await send(speech, "input.done")
        assert (await next_event(speech))["type"] == "audio.start"
        assert (await next_event(realtime))["type"] == "session.created"
        await realtime.send(realtime_speak(LONG))
        while (await next_event(realtime))["type"] != "response.output_audio.delta":
            pass
        body = {"model": "synthetic", "input": LONG, "voice": "tone", "response_format": "pcm", "stream_format": "sse"}
        async with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            sse = sse_events(response)
            assert (await anext(sse))["type"] == "speech.audio.delta"

            (core_pid,) = server.pids("engine core")
            os.kill(core_pid, signal.SIGKILL)

            http_events: list[dict[str, Any]] = []
            with pytest.raises(httpx.RemoteProtocolError):  # a cut-off body is aborted, never finished
                await asyncio.wait_for(collect(sse, http_events), LIMIT_S)
        _, speech_events = await read_to_done(speech)
        async with asyncio.timeout(LIMIT_S):
            while (done := await next_event(realtime))["type"] != "response.done":
                pass

    errors = [e for e in speech_events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["engine_unavailable"]
    assert [e["status"] for e in speech_events if e["type"] == "session.done"] == ["error"]
    assert [e["error"]["code"] for e in http_events if e["type"] == "error"] == ["engine_unavailable"]
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "engine_unavailable"


@asynccontextmanager
async def core_full_behind_the_workers_back(server: CoreServer) -> AsyncIterator[None]:
    """Inside: the worker counts the core's one slot free, but another client of the core holds it, and the core is
    paused. The caller sends an utterance and waits until the worker has admitted it; on exit the core resumes and
    answers the worker's open with its refusal."""
    ((worker_pid,), (core_pid,)) = server.pids("gateway worker 0"), server.pids("engine core")
    await server.wait_ready(200, free_slots=1)
    holder, transport = await connect_core_pool(core_socket(core_pid))
    opened = asyncio.Event()

    def on_outputs(outputs: list[EngineOutput]) -> None:
        opened.set()

    try:
        # The worker, paused, cannot learn from its stats poll that the slot is gone.
        os.kill(worker_pid, signal.SIGSTOP)
        try:
            stream = holder.open(SynthesisParams(voice="tone"), on_outputs, initial_credit_ms=100.0)
            holder.push_text(stream, LONG)
            holder.end_input(stream)
            async with asyncio.timeout(LIMIT_S):
                await opened.wait()
            os.kill(core_pid, signal.SIGSTOP)
        finally:
            os.kill(worker_pid, signal.SIGCONT)
        try:
            yield
        finally:
            os.kill(core_pid, signal.SIGCONT)
    finally:
        await holder.close()
        await transport.close()


async def core_refuses_a_stream(socket_path: str) -> None:
    """Another client of the core asks it for a stream and is refused ``engine_busy``."""
    client, transport = await connect_core_pool(socket_path)
    ended: asyncio.Future[StreamDone] = asyncio.get_running_loop().create_future()

    def on_outputs(outputs: list[EngineOutput]) -> None:
        for output in outputs:
            if isinstance(output, StreamDone) and not ended.done():
                ended.set_result(output)

    try:
        try:
            stream = client.open(SynthesisParams(voice="tone"), on_outputs, initial_credit_ms=100.0)
        except PoolFull:
            return  # refused on the core's own report
        client.push_text(stream, LONG)
        client.end_input(stream)
        async with asyncio.timeout(LIMIT_S):
            done = await ended
        assert done.reason == "error" and done.error is not None and done.error.startswith("engine_busy"), done
    finally:
        await client.close()
        await transport.close()


async def test_a_stream_the_core_refuses_after_its_worker_admitted_it_is_engine_busy(tmp_path: Path) -> None:
    async with core_server(tmp_path, ["--workers", "1", "--model", "rtf=1.0", "-E", "max_sessions=1"]) as server:
        await server.wait_workers_started(1)
        (core_pid,) = server.pids("engine core")
        # A speech session is admitted by the core itself, which holds its place: a stream another client of the
        # core asks for is refused, and the session's utterance is served.
        async with connect(server.url) as ws:
            await send(ws, "session.config", response_format="pcm")
            await server.wait_ready(200, free_slots=0)
            await core_refuses_a_stream(core_socket(core_pid))
            await send(ws, "input.text", text=SENTENCE)
            await send(ws, "input.done")
            _, events = await read_to_done(ws)
        assert not [e for e in events if e["type"] == "error"]
        assert [e["status"] for e in events if e["type"] == "session.done"] == ["completed"]

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=LIMIT_S) as http:
            body = {"model": "synthetic", "input": SENTENCE, "voice": "tone", "response_format": "pcm"}
            async with core_full_behind_the_workers_back(server):
                request = asyncio.ensure_future(http.post("/v1/audio/speech", json=body))
                await server.wait_ready(200, free_slots=0)
            response = await request
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_busy"
        assert response.headers["retry-after"] == "1"
