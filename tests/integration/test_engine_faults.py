"""Engine faults against the real server: a step that raises, a worker that dies, a step that hangs, an engine
that fails every step. Only the affected requests fail, typed; nobody hangs; ``/ready`` follows the engine's health.

The fault engine is the synthetic engine with faults keyed by words in the text, so a test picks which utterance is
hit. Waiting is on protocol events (each read bounded by a deadline that only ends a failing run).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec
import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.engines.base import EngineOutput, EngineStream
from omnigate.engines.synthetic import SyntheticConfig, SyntheticEngine
from omnigate.gateway.settings import Settings
from tests.integration.ws_client import send
from tests.serving import RunningServer, serve

STREAM = "/v1/audio/speech/stream"
READ_LIMIT_S = 20.0


class WorkerKilled(BaseException):
    """Escapes every ``except Exception``: what kills a worker thread outright."""


class FaultEngine(SyntheticEngine):
    """Synthetic speech, except: ``boom`` raises in the step, ``die`` kills the worker, ``garble`` returns the wrong
    number of output lists, ``hang`` blocks the step until released; ``failing`` makes every step raise."""

    def __init__(self, workers: int = 1) -> None:
        super().__init__(SyntheticConfig(max_batch=1))
        self.info = msgspec.structs.replace(self.info, workers=workers)
        self.failing = False
        self.hung = threading.Event()
        self.release = threading.Event()

    def step(self, streams: Sequence[EngineStream], budget_ms: Sequence[float]) -> list[list[EngineOutput]]:
        text = " ".join(t for s in streams for t in s.pending_text)
        if self.failing:
            raise RuntimeError("the device is gone")
        if "boom" in text:
            raise RuntimeError("kaput")
        if "die" in text:
            raise WorkerKilled()
        if "garble" in text:
            return []
        if "hang" in text:
            self.hung.set()
            self.release.wait(60)
        return super().step(streams, budget_ms)


async def speak(ws: ClientConnection, text: str) -> list[dict[str, Any]]:
    """Speak one utterance; every JSON event up to and including its ``session.done``."""
    await send(ws, "input.text", text=text)
    await send(ws, "input.done")
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(READ_LIMIT_S):
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            event = json.loads(message)
            events.append(event)
            if event["type"] == "session.done":
                return events


def outcome(events: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The utterance's status and the codes of the errors it got."""
    return events[-1]["status"], [e["code"] for e in events if e["type"] == "error"]


async def open_session(server: RunningServer) -> ClientConnection:
    ws = await connect(server.ws_url + STREAM)
    await send(ws, "session.config", response_format="pcm", stream_audio=True)
    return ws


async def ready_status(server: RunningServer) -> tuple[int, str]:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        r = await client.get("/ready")
    return r.status_code, r.json()["status"]


def idle(server: RunningServer) -> bool:
    pool = server.gateway.pool
    return pool is not None and pool.active == 0


@pytest.mark.parametrize(
    ("trigger", "error"),
    [("boom", "engine_error: RuntimeError"), ("die", "worker crashed"), ("garble", "worker crashed")],
)
async def test_a_fault_fails_only_its_utterance_and_the_session_goes_on(trigger: str, error: str) -> None:
    engine = FaultEngine()
    with serve(Settings(engine="synthetic"), engine=engine) as server:
        bystander = await open_session(server)
        victim = await open_session(server)
        bystander_utterance = asyncio.create_task(speak(bystander, "A bystander speaks calmly. " * 4))
        status, errors = outcome(await speak(victim, f"This one goes {trigger}."))
        assert status == "error" and errors == ["generation_failed"]
        assert outcome(await bystander_utterance) == ("completed", [])
        # The same session, and the engine, keep working.
        assert outcome(await speak(victim, "Back to normal.")) == ("completed", [])
        failed = [e for e in await speak(victim, f"Again {trigger}.") if e["type"] == "error"]
        assert error in failed[0]["message"]
        await victim.close()
        await bystander.close()
        pool = server.gateway.pool
        assert pool is not None
        assert server.call(lambda: pool.worker_restarts_total) == (2 if trigger != "boom" else 0)
        assert server.call(lambda: idle(server))


async def test_an_engine_that_fails_every_step_turns_unready_and_recovers() -> None:
    engine = FaultEngine()
    with serve(Settings(engine="synthetic", engine_failure_threshold=3), engine=engine) as server:
        ws = await open_session(server)
        engine.failing = True
        for _ in range(3):
            assert outcome(await speak(ws, "Anyone there?"))[0] == "error"
        assert await ready_status(server) == (503, "engine_unhealthy")
        engine.failing = False
        assert outcome(await speak(ws, "Recovered.")) == ("completed", [])
        assert await ready_status(server) == (200, "ready")
        await ws.close()


async def test_a_hung_step_fails_its_requests_at_the_step_timeout() -> None:
    engine = FaultEngine(workers=2)
    with serve(Settings(engine="synthetic", engine_step_timeout_s=0.5), engine=engine) as server:
        victim = await open_session(server)
        bystander = await open_session(server)
        status, errors = outcome(await speak(victim, "This will hang forever."))
        assert status == "error" and errors == ["generation_failed"]
        assert engine.hung.is_set()
        assert (await ready_status(server))[0] == 503
        # The other worker still serves everyone else.
        assert outcome(await speak(bystander, "Still served.")) == ("completed", [])
        engine.release.set()
        await victim.close()
        await bystander.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READ_LIMIT_S
        while (await ready_status(server))[0] != 200:
            assert loop.time() < deadline, "the engine never became ready again"
            await asyncio.sleep(0.05)


async def test_when_every_worker_hangs_nobody_waits_forever() -> None:
    engine = FaultEngine(workers=1)
    with serve(Settings(engine="synthetic", engine_step_timeout_s=0.5), engine=engine) as server:
        victim = await open_session(server)
        queued = await open_session(server)
        victim_utterance = asyncio.create_task(speak(victim, "This will hang."))
        await asyncio.to_thread(engine.hung.wait, READ_LIMIT_S)
        # Queued behind the hung worker: failed typed at the timeout, not left waiting.
        assert outcome(await speak(queued, "Waiting in line."))[0] == "error"
        assert outcome(await victim_utterance)[0] == "error"
        # New work is refused typed while no worker responds.
        status, errors = outcome(await speak(queued, "Anyone?"))
        assert status == "error" and errors == ["engine_unavailable"]
        engine.release.set()
        await victim.close()
        await queued.close()
