"""A small speech-stream client for the tests: send events, collect what the server answers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection


@dataclass
class Utterance:
    starts: list[dict[str, Any]] = field(default_factory=list)
    dones: list[dict[str, Any]] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def pcm(self) -> bytes:
        return b"".join(self.audio)


async def send(ws: ClientConnection, event_type: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": event_type, **fields}))


async def next_json(ws: ClientConnection) -> dict[str, Any]:
    """The next JSON event, failing on binary frames."""
    message = await ws.recv()
    assert isinstance(message, str), "expected a JSON event, got binary audio"
    event: dict[str, Any] = json.loads(message)
    return event


async def collect_utterance(ws: ClientConnection) -> Utterance:
    """Read until session.done; errors fail the test."""
    utt = Utterance()
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            utt.audio.append(message)
            continue
        event = json.loads(message)
        if event["type"] == "audio.start":
            utt.starts.append(event)
        elif event["type"] == "audio.done":
            utt.dones.append(event)
        elif event["type"] == "session.done":
            utt.end = event
            return utt
        else:
            raise AssertionError(f"unexpected event {event}")
