"""Every WebSocket route that reads client JSON refuses a message holding more values than the budget, typed and
before decoding it, and the session goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import ClientConnection, connect

from omnigate.gateway.json_budget import CODE, MAX_JSON_VALUES
from tests.serving import RunningServer
from tests.websocket_routes import serve_every_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_every_engine() as running:
        yield running


def _bomb(kind: str) -> str:
    """A message of ``kind`` that is small in bytes (~200 KB) but holds more values than the budget."""
    return json.dumps({"type": kind, "x": [{}] * (MAX_JSON_VALUES + 1)}, separators=(",", ":"))


async def _next_json(ws: ClientConnection) -> dict[str, object]:
    while True:
        message = await ws.recv()
        if isinstance(message, str):
            event: dict[str, object] = json.loads(message)
            return event


async def _error_code(ws: ClientConnection) -> object:
    while True:
        event = await _next_json(ws)
        if event["type"] == "error":
            error = event.get("error", event)
            assert isinstance(error, dict)
            return error["code"]


async def test_the_speech_stream_refuses_a_value_bomb_and_speaks_after(server: RunningServer) -> None:
    async with connect(f"{server.ws_url}/v1/audio/speech/stream") as ws:
        await ws.send(_bomb("session.config"))
        assert await _error_code(ws) == CODE
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
        await ws.send(json.dumps({"type": "input.done"}))
        while (event := await _next_json(ws))["type"] != "session.done":
            pass
        assert event["status"] == "completed"


async def test_realtime_refuses_a_value_bomb_and_updates_after(server: RunningServer) -> None:
    async with connect(f"{server.ws_url}/v1/realtime") as ws:
        assert (await _next_json(ws))["type"] == "session.created"
        await ws.send(_bomb("session.update"))
        assert await _error_code(ws) == CODE
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "Hi."}}))
        while (event := await _next_json(ws))["type"] != "session.updated":
            assert event["type"] != "error", event


async def test_video_chat_refuses_a_value_bomb_and_answers_after(server: RunningServer) -> None:
    async with connect(f"{server.ws_url}/v1/video/chat/stream") as ws:
        await ws.send(_bomb("ping"))
        assert await _error_code(ws) == CODE
        await ws.send(json.dumps({"type": "ping"}))
        while (event := await _next_json(ws))["type"] != "pong":
            assert event["type"] != "error", event
