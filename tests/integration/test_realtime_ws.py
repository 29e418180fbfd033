"""``WS /v1/realtime`` with text-to-speech engines, driven by the official ``openai`` SDK's realtime client.

Every server event the SDK receives is validated against the SDK's own models.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from omnigate.codecs.resample import StreamResampler
from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from tests.audio_checks import speech_fraction, synthetic_ms
from tests.serving import RunningServer, serve
from tests.unit.test_realtime_protocol import validate_server_event

pytestmark = pytest.mark.integration

LONG_TEXT = "This sentence keeps a real-time response busy for a while. " * 4


@asynccontextmanager
async def realtime(server: RunningServer, **query: str) -> AsyncIterator[AsyncRealtimeConnection]:
    client = AsyncOpenAI(api_key="test-key", base_url=server.http_url + "/v1", websocket_base_url=server.ws_url + "/v1")
    async with client.realtime.connect(model=query.pop("model", "gpt-realtime"), extra_query=query) as connection:
        yield connection


async def recv(connection: AsyncRealtimeConnection) -> dict[str, Any]:
    """The next server event, checked against the SDK's model for its type."""
    async with asyncio.timeout(30):
        raw = await connection.recv_bytes()
    event: dict[str, Any] = json.loads(raw)
    validate_server_event(event)
    assert connection.parse_event(raw).type == event["type"]  # the SDK's own parser reads it too
    return event


async def until(connection: AsyncRealtimeConnection, kind: str) -> list[dict[str, Any]]:
    events = []
    while (event := await recv(connection))["type"] != kind:
        events.append(event)
    return [*events, event]


def pcm_of(events: list[dict[str, Any]], response_id: str | None = None) -> bytes:
    return b"".join(
        base64.b64decode(e["delta"])
        for e in events
        if e["type"] == "response.output_audio.delta" and response_id in (None, e["response_id"])
    )


@pytest.fixture(scope="module")
def realtime_synthetic() -> Iterator[RunningServer]:
    """Synthesis in real time (rtf=1), so a response stays in progress long enough to interrupt."""
    with serve(Settings(engine="synthetic", model="rtf=1.0,sample_rate=24000")) as server:
        yield server


@pytest.fixture(scope="module")
def user_speech(piper_engine: PiperEngine) -> bytes:
    """A spoken user turn made by the piper voice, as 24 kHz PCM with a second of silence around it."""
    samples = piper_engine.synthesize("Wait, stop, I have a question about my order.", speaker_id=None, speed=1.0)
    resampler = StreamResampler(piper_engine.info.sample_rate, 24000)
    speech = resampler.process(samples.astype("<i2").tobytes()) + resampler.flush()
    silence = bytes(48000)
    return silence + speech + silence + silence


async def test_the_sdk_client_speaks_assistant_text_with_piper(piper_server: RunningServer) -> None:
    async with realtime(piper_server) as connection:
        created = await recv(connection)
        assert created["type"] == "session.created"
        assert created["session"]["capabilities"]["native_duplex"] is False
        await connection.session.update(
            session={"type": "realtime", "output_modalities": ["audio"], "audio": {"output": {"voice": "marin"}}}
        )
        updated = await recv(connection)
        assert updated["type"] == "session.updated" and updated["session"]["audio"]["output"]["voice"] == "joe"
        text = "Good evening. Your table for two is booked at eight."
        await connection.conversation.item.create(
            item={
                "type": "message",
                "role": "assistant",
                "id": "agent_reply_1",
                "content": [{"type": "output_text", "text": text}],
            }
        )
        added = await until(connection, "conversation.item.done")
        assert added[0]["item"]["id"] == "agent_reply_1"
        await connection.response.create(response={"metadata": {"client_event_id": "gen_1"}})
        events = await until(connection, "response.done")
    assert events[0]["type"] == "response.created" and events[0]["response"]["metadata"] == {"client_event_id": "gen_1"}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.content_part.added") < kinds.index("response.output_audio.delta")
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["object"] == "realtime.response"
    assert set(done["usage"]) >= {
        "total_tokens",
        "input_tokens",
        "output_tokens",
        "input_token_details",
        "output_token_details",
    }
    transcript = next(e["transcript"] for e in events if e["type"] == "response.output_audio_transcript.done")
    assert transcript == text
    pcm = pcm_of(events)
    assert len(pcm) / 48000 > 1.5  # 24 kHz s16le
    assert speech_fraction(pcm, 24000) > 0.5


async def test_g711_output_and_typed_refusals(synthetic_server: RunningServer) -> None:
    async with realtime(synthetic_server) as connection:
        await recv(connection)
        await connection.session.update(
            session={"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcma"}}}}
        )
        assert (await recv(connection))["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
        await connection.send(
            {
                "type": "session.update",
                "event_id": "bad_1",
                "session": {"type": "realtime", "audio": {"output": {"format": {"type": "audio/opus"}}}},
            }
        )
        error = await recv(connection)
        assert error["error"]["code"] == "unsupported_format" and error["error"]["event_id"] == "bad_1"
        await connection.response.create(
            response={
                "input": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}
                ]
            }
        )
        events = await until(connection, "response.done")
    alaw = pcm_of(events)
    assert len(alaw) == pytest.approx(8 * synthetic_ms("Hello."), abs=16)  # 8 kHz, a byte per sample


async def test_barge_in_cancels_the_response_and_drops_its_queued_audio(
    realtime_synthetic: RunningServer, user_speech: bytes
) -> None:
    async with realtime(realtime_synthetic) as connection:
        await recv(connection)
        await connection.response.create(
            response={
                "input": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]}
                ]
            }
        )
        events = await until(connection, "response.output_audio.delta")
        response_id = events[0]["response"]["id"]
        step = 4800  # 100 ms appends
        for offset in range(0, len(user_speech), step):
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(user_speech[offset : offset + step]).decode()
            )
        events = await until(connection, "input_audio_buffer.speech_started")
        rest = await until(connection, "response.done")
        assert rest[-1]["response"]["id"] == response_id
        assert rest[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        assert not pcm_of(rest, response_id)  # nothing of the response was sent after the barge-in
        stopped = await until(connection, "conversation.item.done")
    kinds = [e["type"] for e in stopped]
    assert kinds[-4:] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert stopped[-4]["item_id"] == events[-1]["item_id"] == stopped[-1]["item"]["id"]
    assert stopped[-4]["audio_end_ms"] > events[-1]["audio_start_ms"] >= 500


async def test_truncate_and_cancel_over_the_wire(realtime_synthetic: RunningServer) -> None:
    async with realtime(realtime_synthetic) as connection:
        await recv(connection)
        await connection.response.create(
            response={
                "input": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG_TEXT}]}
                ]
            }
        )
        events = await until(connection, "response.content_part.added")
        item_id = events[-1]["item_id"]
        received = b""
        while len(received) < 48000 * 0.3:
            event = await recv(connection)
            if event["type"] == "response.output_audio.delta":
                received += base64.b64decode(event["delta"])
        await connection.send(
            {
                "type": "conversation.item.truncate",
                "event_id": "tr_1",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 60_000,
            }
        )
        error = next(e for e in await until(connection, "error") if e["type"] == "error")
        assert error["error"]["code"] == "audio_end_ms_beyond_sent" and error["error"]["event_id"] == "tr_1"
        await connection.response.cancel()
        done = await until(connection, "response.done")
        assert done[-1]["response"]["status"] == "cancelled"
        await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=200)
        truncated = await until(connection, "conversation.item.truncated")
        assert truncated[-1]["audio_end_ms"] == 200


async def test_refusals_before_a_session_starts(synthetic_server: RunningServer) -> None:
    for path, code in (
        ("/v1/realtime?duplex=1", "duplex_unsupported"),
        ("/v1/duplex", "duplex_unsupported"),
        ("/v1/realtime?model=gpt-9", "model_not_found"),
    ):
        async with ws_connect(synthetic_server.ws_url + path) as ws:
            event = json.loads(await ws.recv())
            validate_server_event(event)
            assert event["error"]["code"] == code
            await ws.wait_closed()
            assert ws.close_code == 1008


async def test_an_agent_framework_session_update_is_accepted_and_echoed(synthetic_server: RunningServer) -> None:
    """What LiveKit's and Pipecat's realtime clients send first: instructions, tools, semantic VAD, transcription."""
    async with realtime(synthetic_server) as connection:
        assert (await recv(connection))["type"] == "session.created"
        await connection.session.update(
            session={
                "type": "realtime",
                "instructions": "You are a helpful assistant.",
                "tools": [
                    {
                        "type": "function",
                        "name": "get_weather",
                        "description": "The weather in a city",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    }
                ],
                "tool_choice": "auto",
                "max_output_tokens": "inf",
                "audio": {
                    "input": {
                        "transcription": {"model": "gpt-4o-mini-transcribe"},
                        "turn_detection": {"type": "semantic_vad", "eagerness": "medium", "create_response": True},
                    },
                    "output": {"voice": "marin"},
                },
            }
        )
        updated = await recv(connection)
        assert updated["type"] == "session.updated", updated
        session = updated["session"]
        assert session["instructions"] == "You are a helpful assistant."
        assert [tool["name"] for tool in session["tools"]] == ["get_weather"]
        assert session["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe"}
        assert {"session.instructions", "session.tools", "session.audio.input.turn_detection.type"} <= set(
            session["unused_fields"]
        )
        # The session still speaks what it is given.
        await connection.response.create(
            response={
                "input": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}
                ]
            }
        )
        events = await until(connection, "response.done")
    assert events[-1]["response"]["status"] == "completed" and pcm_of(events)


async def test_session_update_serves_beta_names_names_what_it_does_not_use_and_refuses_an_unknown_voice(
    synthetic_server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """What the openai SDK's beta realtime client sends (top-level voice, modalities, audio formats by name), a field
    no protocol has, and unknown voices: with a plain websockets client."""
    caplog.set_level(logging.INFO, logger="omnigate.sessions.realtime.session")

    async def send(ws: ClientConnection, session: dict[str, Any], event_id: str) -> dict[str, Any]:
        await ws.send(json.dumps({"type": "session.update", "event_id": event_id, "session": session}))
        async with asyncio.timeout(30):
            event: dict[str, Any] = json.loads(await ws.recv())
        validate_server_event(event)
        return event

    async with ws_connect(synthetic_server.ws_url + "/v1/realtime") as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["session"]["unused_fields"] == []
        default_voice = created["session"]["audio"]["output"]["voice"]
        beta = {
            "voice": "alloy",
            "modalities": ["text", "audio"],
            "input_audio_format": "g711_alaw",
            "output_audio_format": "g711_ulaw",
            "foo": 1,
            "audio": {"output": {"bar": True}},
        }
        updated = await send(ws, beta, "beta")
        assert updated["type"] == "session.updated", updated
        session = updated["session"]
        assert session["unused_fields"] == ["session.foo", "session.audio.output.bar"]
        assert session["output_modalities"] == ["audio"]
        assert session["audio"]["input"]["format"]["type"] == "audio/pcma"
        assert session["audio"]["output"]["format"]["type"] == "audio/pcmu"
        alias_voice = session["audio"]["output"]["voice"]
        assert alias_voice in session["capabilities"]["voices"]

        # Beside its GA field a beta name is not used, and says so.
        both = await send(ws, {"voice": "echo", "audio": {"output": {"voice": default_voice}}, "foo": 2}, "both")
        assert both["session"]["audio"]["output"]["voice"] == default_voice
        assert both["session"]["unused_fields"] == ["session.foo", "session.audio.output.bar", "session.voice"]

        # An unknown voice is refused typed wherever it is given, and the session keeps its voice.
        for session_patch, param in (
            ({"voice": "bob"}, "session.voice"),
            ({"audio": {"output": {"voice": "bob"}}}, "session.audio.output.voice"),
        ):
            error = await send(ws, session_patch, f"bad voice at {param}")
            assert error["type"] == "error", error
            assert error["error"]["type"] == "invalid_request_error"
            assert (error["error"]["code"], error["error"]["param"]) == ("unknown_voice", param)
            assert error["error"]["event_id"] == f"bad voice at {param}"
            assert error["error"]["message"].startswith("voice 'bob' is not served; available: ")
        kept = await send(ws, {}, "kept")
        assert kept["session"]["audio"]["output"]["voice"] == default_voice
    # Each unused field is logged once in the session.
    logged = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert len(logged) == 2 and "session.foo" in logged[0] and "session.voice" in logged[1], logged
    assert "session.foo" not in logged[1]
