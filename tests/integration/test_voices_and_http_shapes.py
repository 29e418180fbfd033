"""What a client reads off the HTTP surface: the rate of the audio it got, the voices it may name (OpenAI's names
marked as aliases, in the listing and in the refusal of an unknown voice), and errors in OpenAI's shape even where
Starlette's router answers (a wrong method, an unknown path)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from omnigate.engines.base import OPENAI_VOICES
from tests.integration.ws_client import next_json, send
from tests.serving import RunningServer

pytestmark = pytest.mark.integration

SPEECH = "/v1/audio/speech"
ERROR_FIELDS = {"message", "type", "param", "code"}


def speech_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tts-1", "voice": "alloy", "input": "Hello there.", **fields}


@pytest.mark.parametrize(
    ("response_format", "content_type"),
    [
        ("pcm", "audio/pcm;rate=24000"),
        ("wav", "audio/wav"),
        ("mp3", "audio/mpeg"),
        ("opus", "audio/ogg"),
        ("aac", "audio/aac"),
        ("flac", "audio/flac"),
    ],
)
async def test_http_speech_states_its_sample_rate(
    synthetic_server: RunningServer, response_format: str, content_type: str
) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.post(SPEECH, json=speech_body(response_format=response_format))
    assert r.status_code == 200 and r.content
    assert r.headers["content-type"] == content_type
    assert r.headers["x-sample-rate"] == "24000"


async def test_sse_speech_states_its_sample_rate(synthetic_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.post(SPEECH, json=speech_body(response_format="pcm", stream_format="sse"))
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-sample-rate"] == "24000"


async def test_voices_lists_openai_names_as_aliases(piper_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=piper_server.http_url) as client:
        listing = (await client.get("/v1/audio/voices")).json()
    assert listing["default"] == "joe"
    served = [v for v in listing["voices"] if v["alias_of"] is None]
    aliases = [v for v in listing["voices"] if v["alias_of"] is not None]
    assert [v["id"] for v in served] == ["joe"]
    assert [v["id"] for v in aliases] == list(OPENAI_VOICES)
    assert all(v["alias_of"] == "joe" and "alias of joe" in v["description"] for v in aliases)


async def test_an_unknown_voice_is_refused_with_the_voices_and_aliases(piper_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=piper_server.http_url) as client:
        r = await client.post(SPEECH, json=speech_body(voice="jeo"))
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "unknown_voice" and error["param"] == "voice"
    expected = "voice 'jeo' is not served; available: joe; aliases of these (OpenAI's voice names): alloy, ash,"
    assert error["message"].startswith(expected)
    assert error["message"].endswith(", cedar")
    async with connect(f"{piper_server.ws_url}/v1/audio/speech/stream") as ws:
        await send(ws, "session.config", voice="jeo")
        event = await next_json(ws)
    assert event["code"] == "unknown_voice" and event["message"] == error["message"]


async def test_an_alias_speaks(piper_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=piper_server.http_url) as client:
        r = await client.post(SPEECH, json=speech_body(voice="Nova", response_format="pcm"))
    assert r.status_code == 200 and len(r.content) > 24000


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", SPEECH, 405, "method_not_allowed"),
        ("PUT", SPEECH, 405, "method_not_allowed"),
        ("POST", "/v1/audio/voices", 405, "method_not_allowed"),
        ("GET", "/v1/no-such-route", 404, "not_found"),
    ],
)
async def test_routing_errors_use_openais_shape(
    synthetic_server: RunningServer, method: str, path: str, status: int, code: str
) -> None:
    async with httpx.AsyncClient(base_url=synthetic_server.http_url) as client:
        r = await client.request(method, path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == code
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert path in error["message"]
    if status == 405:
        assert "POST" in r.headers["allow"] or "GET" in r.headers["allow"]
