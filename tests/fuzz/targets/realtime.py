"""``WS /v1/realtime``: the OpenAI Realtime GA client events (turn-based with the speech engine)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import msgspec
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection

from omnigate.gateway.errors import UNDECODABLE
from omnigate.gateway.realtime.protocol import decode_client_event, peek, size_limit
from omnigate.gateway.settings import Settings
from omnigate.sessions.realtime.session import RealtimeLimits
from tests.fuzz.harness import ERROR, VALID, Expectation, FuzzMessage, WsTarget
from tests.fuzz.mutations import json_values, malformed_frames, mutate, strings

PROBE_TEXT = "Probe sentence."
SYNC_PREFIX = "fuzz-sync-"

audio = st.binary(max_size=960).map(lambda b: base64.b64encode(b).decode()) | strings
items = st.fixed_dictionaries(
    {
        "type": st.just("message"),
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "text", "input_audio"]), "text": strings}
            ),
            max_size=2,
        ),
    },
    optional={"id": st.sampled_from(["item_a", "item_b", ""])},
)
sessions = st.fixed_dictionaries(
    {"type": st.sampled_from(["realtime", "transcription"])},
    optional={
        "instructions": strings,
        "output_modalities": st.sampled_from([["audio"], ["text"], ["audio", "text"], []]),
        "audio": st.fixed_dictionaries(
            {},
            optional={
                "output": st.fixed_dictionaries({}, optional={"voice": st.sampled_from(["alloy", "tone", "x"])}),
                "input": st.fixed_dictionaries(
                    {}, optional={"turn_detection": st.sampled_from([None, {"type": "server_vad"}])}
                ),
            },
        ),
    },
)
valid_events = st.one_of(
    st.fixed_dictionaries({"type": st.just("session.update"), "session": sessions}),
    st.fixed_dictionaries({"type": st.just("input_audio_buffer.append"), "audio": audio}),
    st.sampled_from(
        [
            {"type": "input_audio_buffer.commit"},
            {"type": "input_audio_buffer.clear"},
            {"type": "response.cancel"},
            {"type": "output_audio_buffer.clear"},
            {"type": "response.create"},
        ]
    ),
    st.fixed_dictionaries({"type": st.just("conversation.item.create"), "item": items}),
    st.fixed_dictionaries(
        {
            "type": st.just("conversation.item.truncate"),
            "item_id": st.sampled_from(["item_a", "nope"]),
            "content_index": st.integers(-1, 2),
            "audio_end_ms": st.integers(-10, 10_000),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["conversation.item.delete", "conversation.item.retrieve"]), "item_id": strings}
    ),
    st.fixed_dictionaries(
        {"type": st.just("response.create"), "response": st.dictionaries(st.text(max_size=12), json_values, max_size=3)}
    ),
)


def _with_event_id(event: dict[str, Any], event_id: str | None) -> dict[str, Any]:
    return {**event, "event_id": event_id} if event_id is not None else event


class RealtimeTarget(WsTarget):
    name = "realtime"
    path = "/v1/realtime"

    def messages(self) -> st.SearchStrategy[FuzzMessage]:
        limit = RealtimeLimits().max_event_bytes
        addressed = st.builds(_with_event_id, valid_events, st.none() | st.sampled_from(["evt_1", ""]))
        return st.one_of(
            addressed.map(FuzzMessage.json),
            mutate(valid_events, limit).map(FuzzMessage.json),
            json_values.map(FuzzMessage.json),
            malformed_frames(valid_events, limit),
        )

    def expect(self, message: FuzzMessage, settings: Settings) -> Expectation:
        if message.binary:
            return ERROR
        limits = RealtimeLimits()
        raw = message.data
        if len(raw) > limits.max_event_bytes:
            kind, _ = peek(raw)
            if len(raw) > size_limit(kind, limits):
                return ERROR
        try:
            decode_client_event(raw)
        except (msgspec.ValidationError, *UNDECODABLE):
            return ERROR
        return VALID

    def regressions(self) -> list[list[FuzzMessage]]:
        # JSON nested deeper than msgspec recurses once killed the reader and dropped the connection untyped.
        return [[FuzzMessage(b'{"type":' + b"[" * 5000 + b"]" * 5000 + b"}")]]

    def sync(self, n: int) -> FuzzMessage:
        return FuzzMessage.json({"type": "fuzz.sync", "event_id": f"{SYNC_PREFIX}{n}"})

    def sync_reply(self, event: dict[str, Any]) -> int | None:
        if event.get("type") != "error":
            return None
        error = event.get("error") or {}
        event_id = error.get("event_id")
        if error.get("code") != "unknown_event" or not isinstance(event_id, str):
            return None
        return int(event_id.removeprefix(SYNC_PREFIX)) if event_id.startswith(SYNC_PREFIX) else None

    def error_code(self, event: dict[str, Any]) -> str | None:
        assert isinstance(event, dict) and isinstance(event.get("type"), str), event
        assert isinstance(event.get("event_id"), str), event
        if event["type"] != "error":
            return None
        error = event["error"]
        assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str), event
        assert isinstance(error["type"], str), event
        return str(error["code"])

    async def probe(self, ws: ClientConnection) -> None:
        """Cancel whatever the fuzz left, reset the session, have the assistant say one sentence."""
        for event in (
            {"type": "response.cancel"},
            {"type": "input_audio_buffer.clear"},
            {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}},
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": PROBE_TEXT}],
                },
            },
            {"type": "response.create", "event_id": "probe-response"},
        ):
            await ws.send(json.dumps(event))
        async with asyncio.timeout(30.0):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    continue
                event = json.loads(message)
                if event["type"] == "error":
                    assert event["error"].get("event_id") != "probe-response", f"the probe got an error: {event}"
                elif event["type"] == "response.done":
                    status = event["response"]["status"]
                    if status == "completed":
                        return
                    assert status == "cancelled", event  # a response the fuzz had started, cancelled above


TARGET = RealtimeTarget()
