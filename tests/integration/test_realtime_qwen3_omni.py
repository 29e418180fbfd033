"""``--engine qwen3-omni`` (``preset:tiny`` on the CPU) through the real server: /v1/realtime answered by the model
itself, with no LLM or recognizer, spoken and text turns (the spoken one's audio counted in /metrics by the input
encoder), a long turn encoded window by window while it is appended; cancel mid-answer; the speech routes refused,
typed."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect as ws_connect

from omnigate.engines.piper import PiperEngine
from omnigate.gateway.settings import Settings
from omnigate.loadtest.metrics import parse_metrics
from tests.integration.test_realtime_answer import say, utterance
from tests.integration.test_realtime_ws import pcm_of, realtime, recv, until
from tests.serving import RunningServer, serve

pytestmark = pytest.mark.integration

FRAME_BYTES = 2 * 1920  # one codec frame of the voice: 80 ms of 24 kHz s16le


@pytest.fixture(scope="module")
def omni_server() -> Iterator[RunningServer]:
    settings = Settings(
        engine="qwen3-omni", model="preset:tiny", engine_options={"max_sessions": "2", "max_context": "512"}
    )
    with serve(settings) as server:
        yield server


def speech(seconds: float) -> bytes:
    """Seeded noise standing for the user's speech (the preset's weights are random: any audio is a question)."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal(int(24000 * seconds)) * 3000).astype("<i2").tobytes()


async def answered(connection: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events = await until(connection, "response.done")
    return events, events[-1]["response"]


async def encoder_counter(server: RunningServer, name: str) -> float:
    """One of the engine's input encoder counters, as ``/metrics`` says."""
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        metrics = parse_metrics((await client.get("/metrics")).text)
    return metrics[name][1]


async def encoded_turns(server: RunningServer) -> float:
    """User turns the engine's input encoder has encoded."""
    return await encoder_counter(server, 'omnigate_qwen3_omni_encoder_items_total{input="audio"}')


def transcript(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")


async def test_a_spoken_and_a_text_turn_are_answered_in_the_models_voice(omni_server: RunningServer) -> None:
    async with realtime(omni_server) as connection:
        created = await recv(connection)
        assert created["session"]["capabilities"]["engine"] == "qwen3-omni"
        assert created["session"]["audio"]["output"]["voice"] == "ethan"
        # OpenAI's voice names are aliases of the model's speakers.
        audio = {"input": {"turn_detection": None}, "output": {"voice": "alloy"}}
        await connection.session.update(session={"type": "realtime", "audio": audio})
        updated = await recv(connection)
        assert updated["session"]["audio"]["output"]["voice"] in ("aiden", "chelsie", "ethan")
        # A spoken turn: appended, committed, then answered.
        before = await encoded_turns(omni_server)
        await connection.input_audio_buffer.append(audio=base64.b64encode(speech(0.5)).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create(response={"max_output_tokens": 6})
        events, done = await answered(connection)
        assert "input_audio_buffer.committed" in [e["type"] for e in events]
        assert done["status"] in ("completed", "incomplete"), done
        audio = pcm_of(events, done["id"])
        assert audio and len(audio) % FRAME_BYTES == 0
        text = transcript(events)
        assert text and done["output"][0]["content"][0]["transcript"] == text
        assert 0 < done["usage"]["output_token_details"]["text_tokens"] <= 6
        assert await encoded_turns(omni_server) == before + 1  # by the engine's encoder thread (in /metrics)
        # A text turn in the same conversation.
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}
        )
        await connection.response.create(response={"max_output_tokens": 6})
        events, done = await answered(connection)
        assert done["status"] in ("completed", "incomplete"), done
        assert pcm_of(events, done["id"]) and transcript(events)
        assert not [e for e in events if e["type"] == "error"]


async def test_a_turn_server_vad_ends_is_answered_without_response_create(
    omni_server: RunningServer, piper_engine: PiperEngine
) -> None:
    async with realtime(omni_server) as connection:
        created = await recv(connection)
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await connection.session.update(session={"type": "realtime", "max_output_tokens": 6})
        assert (await recv(connection))["type"] == "session.updated"
        await say(connection, utterance(piper_engine, "What is the weather like today?"))
        events, done = await answered(connection)
        kinds = [e["type"] for e in events]
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
        assert done["status"] in ("completed", "incomplete") and pcm_of(events, done["id"]) and transcript(events)


async def test_a_long_turn_is_encoded_window_by_window_as_it_is_appended(omni_server: RunningServer) -> None:
    ahead = "omnigate_qwen3_omni_encoder_windows_ahead_total"
    kept = "omnigate_qwen3_omni_encoder_windows_kept_total"
    async with realtime(omni_server) as connection:
        await recv(connection)
        await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await recv(connection)
        before = (await encoder_counter(omni_server, ahead), await encoder_counter(omni_server, kept))
        turn = speech(17.5)
        piece = 2 * 2400  # 100 ms appends, as a client streams its microphone
        for start in range(0, len(turn), piece):
            await connection.input_audio_buffer.append(audio=base64.b64encode(turn[start : start + piece]).decode())
        # Two whole 8-s windows were encoded while the turn was still open (a speaker takes 17 s to say it).
        deadline = asyncio.get_running_loop().time() + 120  # (bounds a failing run only)
        while await encoder_counter(omni_server, ahead) < before[0] + 2:
            assert asyncio.get_running_loop().time() < deadline, "the turn's windows were not encoded ahead"
            await asyncio.sleep(0.05)
        await connection.input_audio_buffer.commit()
        await connection.response.create(response={"max_output_tokens": 4})
        events, done = await answered(connection)
        assert done["status"] in ("completed", "incomplete") and pcm_of(events, done["id"]), done
        assert await encoder_counter(omni_server, kept) == before[1] + 2  # the turn's end encoded only the rest


async def test_cancel_mid_answer_stops_it_and_the_next_answer_runs(omni_server: RunningServer) -> None:
    async with realtime(omni_server) as connection:
        await recv(connection)
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "talk a while"}]}
        )
        await connection.response.create(response={"max_output_tokens": 400})
        first = await until(connection, "response.output_audio.delta")
        await connection.response.cancel()
        rest, done = await answered(connection)
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
        # The transcript kept is what the response sent, far short of the 400 tokens asked for.
        kept = done["output"][0]["content"][0]["transcript"]
        assert kept == transcript(first + rest) and len(kept) < 400
        await connection.response.create(response={"max_output_tokens": 4})
        events, done = await answered(connection)
        assert done["status"] in ("completed", "incomplete") and pcm_of(events, done["id"])


async def test_the_speech_routes_are_refused_naming_the_route_served(omni_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=omni_server.http_url) as client:
        response = await client.post("/v1/audio/speech", json={"model": "qwen3-omni", "input": "hi", "voice": "ethan"})
    assert response.status_code >= 400
    error = response.json()["error"]
    assert error["code"] == "unsupported" and "/v1/realtime" in error["message"]
    async with ws_connect(omni_server.ws_url + "/v1/audio/speech/stream") as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "ethan", "response_format": "pcm"}))
        await ws.send(json.dumps({"type": "input.text", "text": "hi there."}))
        await ws.send(json.dumps({"type": "input.done"}))
        events = []
        async for raw in ws:
            if isinstance(raw, str):
                events.append(json.loads(raw))
                if events[-1]["type"] == "error":
                    break
    [refusal] = [e for e in events if e["type"] == "error"]
    assert refusal["code"] == "unsupported" and "/v1/realtime" in refusal["message"]


async def test_a_conversation_past_the_context_fails_its_response_typed(omni_server: RunningServer) -> None:
    async with realtime(omni_server) as connection:
        await recv(connection)
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "word " * 120}]}
        )
        await connection.response.create()
        events, done = await answered(connection)
        assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "context_length_exceeded"
        # The session goes on: once the long item is deleted, the conversation is answered.
        [long_item] = [e["item"]["id"] for e in events if e["type"] == "conversation.item.added"][:1]
        await connection.conversation.item.delete(item_id=long_item)
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "short"}]}
        )
        await connection.response.create(response={"max_output_tokens": 4})
        _, done = await answered(connection)
        assert done["status"] in ("completed", "incomplete")
