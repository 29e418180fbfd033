"""Graceful drain of a real ``omnigate serve`` process on SIGTERM, with realtime sessions (WebSocket and WebRTC).

The synthetic engine speaks at real time (``rtf=1``), so a response is still in progress when the signal arrives.
A realtime session with no response in progress is closed at once (``error`` ``shutting_down``, close 1012); one
responding finishes its response, then is closed the same way; at the deadline a response still in progress ends
with ``response.done`` status ``cancelled`` before the typed close. Every step waits on protocol events.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.webrtc.call import REALTIME_CHANNEL
from tests.integration.test_drain import ServerProcess, close_code, next_event, server_process
from tests.integration.test_webrtc import Listener, call

pytestmark = pytest.mark.slow

SHORT = "This reply takes about three seconds to say out loud."
LONG = "This reply goes on for far longer than the drain deadline allows. " * 12
RTC_ARGS = ("--webrtc-host-address", "127.0.0.1")
READ_LIMIT_S = 30.0


def realtime_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime"


def speak(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"type": "response.create", "response": {"input": [message]}}


async def opened(server: ServerProcess) -> ClientConnection:
    ws = await connect(realtime_url(server), compression=None)
    assert (await next_event(ws))["type"] == "session.created"
    return ws


async def responding(server: ServerProcess, text: str) -> ClientConnection:
    ws = await opened(server)
    await ws.send(json.dumps(speak(text)))
    while (await next_event(ws))["type"] != "response.output_audio.delta":
        pass
    return ws


async def rest(ws: ClientConnection) -> list[dict[str, Any]]:
    """Every event up to and including the ``error`` that ends the session."""
    events = [await next_event(ws)]
    while events[-1]["type"] != "error":
        events.append(await next_event(ws))
    return events


async def test_sigterm_closes_idle_realtime_sessions_at_once_and_lets_responses_finish(tmp_path: Path) -> None:
    async with server_process(tmp_path, drain_timeout_s=30.0) as server:
        idle = await opened(server)
        busy = await responding(server, SHORT)
        server.process.send_signal(signal.SIGTERM)

        error = await next_event(idle)
        assert error["type"] == "error" and error["error"]["code"] == "shutting_down"
        assert await close_code(idle) == 1012
        # The response in progress finishes, completed, and only then is its session closed.
        events = await rest(busy)
        kinds = [e["type"] for e in events]
        assert kinds.index("response.done") < len(kinds) - 1
        [done] = [e for e in events if e["type"] == "response.done"]
        assert done["response"]["status"] == "completed"
        assert events[-1]["error"]["code"] == "shutting_down"
        assert await close_code(busy) == 1012
        assert await server.exit_code() == 0
        log = server.log.read_text()
        assert "2 live sessions" in log and "0 at the deadline" in log


async def test_a_realtime_response_still_running_at_the_deadline_is_cancelled_then_closed(tmp_path: Path) -> None:
    async with server_process(tmp_path, drain_timeout_s=1.0) as server:
        busy = await responding(server, LONG)
        server.process.send_signal(signal.SIGTERM)
        events = await rest(busy)
        [done] = [e for e in events if e["type"] == "response.done"]
        assert done["response"]["status"] == "cancelled"
        assert [e["type"] for e in events[-2:]] == ["response.done", "error"]
        assert events[-1]["error"]["code"] == "shutting_down"
        assert await close_code(busy) == 1012
        assert await server.exit_code() == 0
        assert "1 at the deadline" in server.log.read_text()


@dataclass
class Address:
    http_url: str


@asynccontextmanager
async def realtime_call(server: ServerProcess, listener: Listener) -> AsyncIterator[Any]:
    async with call(Address(f"http://127.0.0.1:{server.port}"), listener, None, REALTIME_CHANNEL) as peer:  # type: ignore[arg-type]
        await listener.until(lambda: bool(listener.of("session.created")))
        yield peer


async def test_sigterm_drains_realtime_webrtc_calls_idle_at_once_responding_at_the_deadline(tmp_path: Path) -> None:
    async with server_process(tmp_path, 1.5, RTC_ARGS) as server:
        idle_listener, busy_listener = Listener(), Listener()
        async with realtime_call(server, idle_listener), realtime_call(server, busy_listener) as busy:
            busy.send_json(speak(LONG))
            await busy_listener.until(lambda: bool(busy_listener.of("output_audio_buffer.started")))
            server.process.send_signal(signal.SIGTERM)
            await idle_listener.until(lambda: bool(idle_listener.of("error")))
            assert not busy_listener.of("error")  # still responding when the idle call was closed
            await busy_listener.until(lambda: bool(busy_listener.of("error")))
        assert [e["error"]["code"] for e in idle_listener.of("error")] == ["shutting_down"]
        assert [e["error"]["code"] for e in busy_listener.of("error")] == ["shutting_down"]
        [done] = busy_listener.of("response.done")
        assert done["response"]["status"] == "cancelled"
        assert await server.exit_code() == 0
        log = server.log.read_text()
        assert "1 sessions closed when idle, 1 at the deadline" in log
