"""``WS /v1/audio/speech/stream``: session.config, input.text, input.done, input.cancel, session.close."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgspec
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection

from omnigate.gateway.errors import UNDECODABLE
from omnigate.gateway.settings import Settings
from omnigate.gateway.speech.protocol import SessionCloseEvent, decode_client_event, event_type_of
from tests.fuzz.harness import ERROR, VALID, Expectation, FuzzMessage, WsTarget
from tests.fuzz.mutations import json_values, malformed_frames, mutate, strings

_SYNC = re.compile(r"'fuzz\.sync\.(\d+)'")
_SERVER_EVENTS = {
    "audio.start": ("utterance_index", "sentence_index", "format", "sample_rate"),
    "audio.done": ("utterance_index", "sentence_index", "total_bytes"),
    "session.done": ("utterance_index", "total_sentences", "status"),
    "error": ("code", "message"),
}
PROBE_TEXT = "Probe sentence."

configs = st.fixed_dictionaries(
    {"type": st.just("session.config")},
    optional={
        "response_format": st.sampled_from(["pcm", "wav", "mp3", "opus", "flac", "aac", "ogg"]),
        "voice": st.sampled_from(["tone", "noise", "alloy", "nobody"]),
        "speaker": st.sampled_from(["tone", "x"]),
        "stream_audio": st.booleans(),
        "speed": st.floats(0.1, 5.0),
        "sample_rate": st.sampled_from([8000, 16000, 24000, 48000, 7, 96000]),
        "language": st.sampled_from(["en", "fr", "auto", "en-US"]),
        "split_granularity": st.sampled_from(["sentence", "clause", "word"]),
        "model": st.sampled_from(["synthetic", "tts-1", "nope"]),
        "max_new_tokens": st.integers(-1, 20),
        "instructions": strings,
        "task_type": st.sampled_from(["CustomVoice", "Base"]),
        "ref_audio": st.just("data:,"),
    },
)
texts = st.fixed_dictionaries({"type": st.just("input.text"), "text": strings})
controls = st.sampled_from([{"type": "input.done"}, {"type": "input.cancel"}])
valid_events = st.one_of(configs, texts, controls, texts, controls, st.just({"type": "session.close"}))


class SpeechStreamTarget(WsTarget):
    name = "speech-stream"
    path = "/v1/audio/speech/stream"

    def messages(self) -> st.SearchStrategy[FuzzMessage]:
        limit = Settings().ws_max_text_event_bytes
        events = valid_events.filter(lambda e: e["type"] != "session.close") | st.just({"type": "session.close"})
        return st.one_of(
            events.map(FuzzMessage.json),
            mutate(valid_events, limit).map(FuzzMessage.json),
            json_values.map(FuzzMessage.json),
            malformed_frames(valid_events, limit),
        )

    def expect(self, message: FuzzMessage, settings: Settings) -> Expectation:
        if message.binary:
            return ERROR
        text = message.data.decode("utf-8")
        if len(message.data) > settings.ws_max_text_event_bytes and event_type_of(text) != "session.config":
            return ERROR
        try:
            event = decode_client_event(text)
        except (msgspec.ValidationError, *UNDECODABLE):
            return ERROR
        if isinstance(event, SessionCloseEvent):
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
        match = _SYNC.search(event.get("message", ""))
        return int(match.group(1)) if match else None

    def error_code(self, event: dict[str, Any]) -> str | None:
        assert isinstance(event, dict) and event.get("type") in _SERVER_EVENTS, event
        for name in _SERVER_EVENTS[event["type"]]:
            assert name in event, (name, event)
        if event["type"] != "error":
            return None
        assert isinstance(event["code"], str) and event["code"] and isinstance(event["message"], str), event
        return str(event["code"])

    async def probe(self, ws: ClientConnection) -> None:
        """Cancel whatever the fuzz left, configure afresh, and speak one sentence to completion."""
        await ws.send(json.dumps({"type": "input.cancel"}))
        config = {"type": "session.config", "response_format": "pcm", "voice": "tone", "stream_audio": True}
        await ws.send(json.dumps(config))
        await ws.send(json.dumps({"type": "input.text", "text": PROBE_TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        audio = 0
        started = False
        async with asyncio.timeout(30.0):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    audio += len(message) if started else 0
                    continue
                event = json.loads(message)
                assert event["type"] != "error", f"the probe got an error: {event}"
                if event["type"] == "audio.start" and event["sentence_text"] == PROBE_TEXT:
                    started = True
                elif event["type"] == "session.done" and started:
                    assert event["status"] == "completed" and audio > 0, event
                    return


TARGET = SpeechStreamTarget()
