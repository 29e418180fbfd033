"""``WS /v1/realtime/video``: video.create, video.cancel, session.close (needs the server's video engine: the fuzz
server loads the ``preset:tiny`` model with a pixel budget that keeps every admitted clip tiny)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection

from omnigate.gateway.errors import UNDECODABLE
from omnigate.gateway.settings import Settings
from omnigate.gateway.video.protocol import ClientEvent, SessionClose
from tests.fuzz.harness import ERROR, VALID, Expectation, FuzzMessage, WsTarget
from tests.fuzz.mutations import json_values, malformed_frames, mutate, strings

PROBE_SEED = 271_828  # the fuzz draws seeds too; this one is unlikely to be among them
PROBE = {
    "type": "video.create",
    "prompt": "probe",
    "width": 32,
    "height": 32,
    "num_frames": 5,
    "steps": 1,
    "seed": PROBE_SEED,
}
_SERVER_EVENTS = {"video.start": ("mime",), "video.done": ("status",), "error": ("code", "message")}
_SYNC_PREFIX = "'fuzz.sync."

creates = st.fixed_dictionaries(
    {"type": st.just("video.create"), "prompt": strings},
    optional={
        "width": st.sampled_from([32, 33, 64, 0, -16, 100_000]),
        "height": st.sampled_from([32, 64, 0, 7]),
        "num_frames": st.sampled_from([1, 5, 9, 0, -1, 10_000]),
        "fps": st.sampled_from([1, 8, 0, 1000]),
        "steps": st.sampled_from([1, 0, -3, 10_000]),
        "seed": st.integers(-(2**40), 2**40),
        "guidance_scale": st.floats(-5.0, 50.0),
        "model": st.sampled_from(["tiny", "nope"]),
    },
)
valid_events = st.one_of(creates, st.just({"type": "video.cancel"}), st.just({"type": "session.close"}))


class VideoTarget(WsTarget):
    name = "video"
    path = "/v1/realtime/video"

    def messages(self) -> st.SearchStrategy[FuzzMessage]:
        limit = Settings().ws_max_text_event_bytes
        return st.one_of(
            valid_events.map(FuzzMessage.json),
            mutate(valid_events, limit).map(FuzzMessage.json),
            json_values.map(FuzzMessage.json),
            malformed_frames(valid_events, limit),
        )

    def expect(self, message: FuzzMessage, settings: Settings) -> Expectation:
        if message.binary or len(message.data) > settings.ws_max_text_event_bytes:
            return ERROR
        try:
            event = msgspec.json.decode(message.data, type=ClientEvent)
        except (msgspec.ValidationError, *UNDECODABLE):
            return ERROR
        if isinstance(event, SessionClose):
            return Expectation("close", frozenset({1000}))
        return VALID

    def regressions(self) -> list[list[FuzzMessage]]:
        # JSON nested deeper than msgspec recurses once killed the reader and dropped the connection untyped.
        return [[FuzzMessage(b"[" * 5000 + b"]" * 5000)]]

    def sync(self, n: int) -> FuzzMessage:
        return FuzzMessage.json({"type": f"fuzz.sync.{n}"})

    def sync_reply(self, event: dict[str, Any]) -> int | None:
        if event.get("type") != "error" or event.get("code") != "unknown_event":
            return None
        message = str(event.get("message", ""))
        start = message.find(_SYNC_PREFIX)
        if start < 0:
            return None
        digits = message[start + len(_SYNC_PREFIX) :].split("'")[0]
        return int(digits) if digits.isdigit() else None

    def error_code(self, event: dict[str, Any]) -> str | None:
        assert isinstance(event, dict) and event.get("type") in _SERVER_EVENTS, event
        for name in _SERVER_EVENTS[event["type"]]:
            assert name in event, (name, event)
        if event["type"] != "error":
            return None
        assert isinstance(event["code"], str) and event["code"] and isinstance(event["message"], str), event
        return str(event["code"])

    async def probe(self, ws: ClientConnection) -> None:
        """Cancel what the fuzz started, then generate one tiny clip (known by its seed) to completion; while an
        earlier generation is still ending the create is refused ``busy`` and sent again once it has ended."""
        await ws.send(json.dumps({"type": "video.cancel"}))
        await ws.send(json.dumps(PROBE))
        ended_since_create = False
        waiting = False
        ours = False
        async with asyncio.timeout(60.0):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    continue
                event = json.loads(message)
                if event["type"] == "error":
                    assert event["code"] == "busy", f"the probe got an error: {event}"
                    if ended_since_create:
                        await ws.send(json.dumps(PROBE))
                        ended_since_create = False
                    else:
                        waiting = True
                elif event["type"] == "video.start":
                    ours = event.get("seed") == PROBE["seed"]
                elif event["type"] == "video.done":
                    if ours:
                        assert event["status"] == "completed", event
                        return
                    if waiting:
                        await ws.send(json.dumps(PROBE))
                        waiting = False
                    else:
                        ended_since_create = True


TARGET = VideoTarget()
