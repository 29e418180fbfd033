"""Authentication on every route of the real server: API keys, browser client secrets, per-key limits, refusals.

WebSocket refusals must come before the handshake completes, as an HTTP response the client can read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from omnigate.gateway.security.credentials import ClientSecretStore, MintedSecret, api_key_hash, key_principal
from omnigate.gateway.settings import Settings
from tests.fuzz.server import settle
from tests.integration.ws_client import collect_utterance, send
from tests.serving import RunningServer, serve

STREAM = "/v1/audio/speech/stream"
KEY = "test-key-one"
OTHER_KEY = "test-key-two"
SPEECH = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "pcm"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keyed_settings(**extra: Any) -> Settings:
    return Settings(engine="synthetic", api_key_hashes=(api_key_hash(KEY), api_key_hash(OTHER_KEY)), **extra)


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[RunningServer]:
    with serve(keyed_settings()) as server:
        yield server


async def mint(server: RunningServer, key: str = KEY, **body: Any) -> str:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        r = await client.post("/v1/realtime/client_secrets", headers=bearer(key), json=body)
    assert r.status_code == 200, r.text
    value: str = r.json()["value"]
    return value


async def refused_ws(url: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """Connect expecting an HTTP refusal of the handshake; returns its status and JSON body."""
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, **kwargs):
            pass
    response = refused.value.response
    return response.status_code, json.loads(bytes(response.body or b""))


async def speak_once(url: str, **kwargs: Any) -> str:
    async with connect(url, **kwargs) as ws:
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text="Hello.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
        assert utt.end is not None
        return str(utt.end["status"])


async def test_http_routes_need_a_valid_key_and_probes_stay_open(keyed_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=keyed_server.http_url) as client:
        missing = await client.post("/v1/audio/speech", json=SPEECH)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = await client.post("/v1/audio/speech", json=SPEECH, headers=bearer("nope"))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status_code == 401
        ok = await client.post("/v1/audio/speech", json=SPEECH, headers=bearer(KEY))
        assert ok.status_code == 200 and len(ok.content) > 0
        for path in ("/health", "/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200, path
        metrics = (await client.get("/metrics")).text
    assert 'omnigate_requests_refused_total{reason="missing_api_key"}' in metrics


async def test_websocket_without_a_key_is_refused_before_accept(keyed_server: RunningServer) -> None:
    url = keyed_server.ws_url + STREAM
    status, body = await refused_ws(url)
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    status, body = await refused_ws(url, additional_headers=bearer("wrong"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    # An API key never travels in the URL; OpenAI's "insecure API key" subprotocol is accepted, like OpenAI does.
    status, body = await refused_ws(url + f"?token={KEY}")
    assert status == 401
    async with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        assert ws.subprotocol == "realtime"
    status, _ = await refused_ws(url, subprotocols=["openai-insecure-api-key.wrong"])
    assert status == 401
    assert keyed_server.call(lambda: keyed_server.gateway.registry.admitted_total["ws-speech"]) == 1
    assert await speak_once(url, additional_headers=bearer(KEY)) == "completed"


async def test_the_openai_sdk_mints_a_client_secret(keyed_server: RunningServer) -> None:
    client = openai.AsyncOpenAI(api_key=KEY, base_url=keyed_server.http_url + "/v1")
    secret = await client.realtime.client_secrets.create(expires_after={"anchor": "created_at", "seconds": 30})
    assert secret.value.startswith("ek_")
    status, _ = await refused_ws(keyed_server.ws_url + STREAM, additional_headers=bearer("ek_made_up"))
    assert status == 401
    assert await speak_once(keyed_server.ws_url + STREAM, additional_headers=bearer(secret.value)) == "completed"
    anonymous = openai.AsyncOpenAI(api_key="wrong", base_url=keyed_server.http_url + "/v1")
    with pytest.raises(openai.AuthenticationError):
        await anonymous.realtime.client_secrets.create()


async def test_a_client_secret_opens_one_websocket_session_from_a_browser(keyed_server: RunningServer) -> None:
    url = keyed_server.ws_url + STREAM
    secret = await mint(keyed_server)
    # A browser offers its protocol and the secret; the server must select one, and never the secret when it can.
    async with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{secret}"]) as ws:
        assert ws.subprotocol == "realtime"
    status, body = await refused_ws(url, subprotocols=[f"openai-insecure-api-key.{secret}"])
    assert status == 403 and body["error"]["code"] == "client_secret_used"

    alone = await mint(keyed_server)
    async with connect(url, subprotocols=[f"openai-insecure-api-key.{alone}"]) as ws:
        assert ws.subprotocol == f"openai-insecure-api-key.{alone}"

    by_query = await mint(keyed_server)
    assert await speak_once(url + f"?token={by_query}") == "completed"
    status, _ = await refused_ws(url + f"?token={by_query}")
    assert status == 403


async def test_an_expired_client_secret_is_refused(keyed_server: RunningServer) -> None:
    store: ClientSecretStore = keyed_server.app.state.client_secrets
    expired = keyed_server.call(lambda: store.mint(key_principal("0" * 64), 10.0, time.time() - 11.0))
    assert isinstance(expired, MintedSecret)
    status, body = await refused_ws(keyed_server.ws_url + STREAM, additional_headers=bearer(expired.value))
    assert status == 401 and body["error"]["code"] == "expired_client_secret"


async def test_client_secrets_open_sessions_only(keyed_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=keyed_server.http_url) as client:
        speech = await client.post("/v1/audio/speech", json=SPEECH, headers=bearer(await mint(keyed_server)))
        assert speech.status_code == 403 and speech.json()["error"]["code"] == "client_secret_not_allowed"
        more = await client.post("/v1/realtime/client_secrets", headers=bearer(await mint(keyed_server)))
        assert more.status_code == 403
        # The WebRTC offer route takes the ephemeral key in its Authorization header: auth passes, and the route
        # answers this empty offer itself.
        call = await client.post(
            "/v1/realtime/calls",
            content=b"",
            headers={**bearer(await mint(keyed_server)), "content-type": "application/sdp"},
        )
        assert call.status_code not in (401, 403), call.text
        too_long = await client.post(
            "/v1/realtime/client_secrets", headers=bearer(KEY), json={"expires_after": {"seconds": 999_999}}
        )
        assert too_long.status_code == 400
        bad = await client.post("/v1/realtime/client_secrets", headers=bearer(KEY), content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


async def test_a_client_secret_opens_a_video_chat_call(keyed_server: RunningServer) -> None:
    """``/static/video-chat.js`` posts its offer with a minted secret, as the realtime page does."""
    async with httpx.AsyncClient(base_url=keyed_server.http_url) as client:
        call = await client.post(
            "/v1/video/chat/calls",
            content=b"v=0",
            headers={**bearer(await mint(keyed_server)), "content-type": "application/sdp"},
        )
    # Past authentication, the route itself refuses this offer (no audio section).
    assert call.status_code == 400 and call.json()["error"]["code"] == "invalid_offer", call.text


async def test_sessions_per_key_are_capped_with_a_typed_refusal() -> None:
    with serve(keyed_settings(max_sessions_per_key=1)) as server:
        url = server.ws_url + STREAM
        async with connect(url, additional_headers=bearer(KEY)) as held:
            await send(held, "session.config", response_format="pcm")
            status, body = await refused_ws(url, additional_headers=bearer(KEY))
            assert status == 429 and body["error"]["code"] == "session_limit_per_key"
            # A browser secret minted with the same key counts against it too.
            status, _ = await refused_ws(url, additional_headers=bearer(await mint(server)))
            assert status == 429
            async with httpx.AsyncClient(base_url=server.http_url) as client:
                r = await client.post("/v1/audio/speech", json=SPEECH, headers=bearer(KEY))
                assert r.status_code == 429 and "retry-after" in r.headers
            assert await speak_once(url, additional_headers=bearer(OTHER_KEY)) == "completed"
        await settle(server)  # the server releases the session once it has seen the close
        assert await speak_once(url, additional_headers=bearer(KEY)) == "completed"


async def test_request_rate_per_key_is_limited() -> None:
    with serve(keyed_settings(requests_per_s_per_key=0.01, request_burst_per_key=2)) as server:
        async with httpx.AsyncClient(base_url=server.http_url) as client:
            statuses = [(await client.get("/v1/models", headers=bearer(KEY))).status_code for _ in range(3)]
            assert statuses == [200, 200, 429]
            limited = await client.get("/v1/models", headers=bearer(KEY))
            assert int(limited.headers["retry-after"]) >= 1
            assert limited.json()["error"]["code"] == "rate_limited"
            assert (await client.get("/v1/models", headers=bearer(OTHER_KEY))).status_code == 200
        status, body = await refused_ws(server.ws_url + STREAM, additional_headers=bearer(KEY))
        assert status == 429 and body["error"]["code"] == "rate_limited"


def test_metrics_can_require_a_key() -> None:
    with serve(keyed_settings(metrics_require_auth=True)) as server, httpx.Client(base_url=server.http_url) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=bearer(KEY)).status_code == 200
        assert c.get("/health").status_code == 200


async def test_without_keys_everything_is_open() -> None:
    with serve(Settings(engine="synthetic")) as server:
        assert await speak_once(server.ws_url + STREAM) == "completed"
        secret = await mint(server, key="anything")
        async with connect(
            server.ws_url + STREAM, subprotocols=["realtime", f"openai-insecure-api-key.{secret}"]
        ) as ws:
            assert ws.subprotocol == "realtime"


def test_no_key_on_a_public_address_refuses_to_start() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnigate.gateway.cli", "serve", "--engine", "synthetic", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "without authentication" in result.stderr and "--allow-unauthenticated-public" in result.stderr


async def test_the_session_minted_with_a_secret_configures_the_realtime_session(keyed_server: RunningServer) -> None:
    session = {"type": "realtime", "audio": {"output": {"voice": "noise", "speed": 1.25}}}
    secret = await mint(keyed_server, session=session)
    async with connect(keyed_server.ws_url + "/v1/realtime", additional_headers=bearer(secret)) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        updated = json.loads(await ws.recv())
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["audio"]["output"]["voice"] == "noise"
        assert updated["session"]["audio"]["output"]["speed"] == 1.25


async def test_the_session_minted_with_a_secret_configures_the_speech_stream(keyed_server: RunningServer) -> None:
    secret = await mint(keyed_server, session={"type": "speech", "response_format": "pcm", "stream_audio": True})
    async with connect(keyed_server.ws_url + STREAM, additional_headers=bearer(secret)) as ws:
        # No session.config from the browser: the minted one applies.
        await send(ws, "input.text", text="Configured by the app server.")
        await send(ws, "input.done")
        utt = await collect_utterance(ws)
    assert utt.end is not None and utt.end["status"] == "completed"
    assert utt.starts[0]["format"] == "pcm" and len(utt.pcm) > 0


async def test_minted_sessions_are_checked_bounded_and_capped_per_key() -> None:
    with serve(keyed_settings(max_client_secrets_per_key=2, client_secret_max_session_bytes=1024)) as server:
        async with httpx.AsyncClient(base_url=server.http_url, headers=bearer(KEY)) as client:
            path = "/v1/realtime/client_secrets"
            big = await client.post(path, json={"session": {"type": "realtime", "instructions": "x" * 2000}})
            assert big.status_code == 400 and big.json()["error"]["param"] == "session"
            wrong = await client.post(path, json={"session": {"type": "speech", "colour": "blue"}})
            assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "invalid_value"
            kind = await client.post(path, json={"session": {"type": "video"}})
            assert kind.status_code == 400 and kind.json()["error"]["param"] == "session.type"
            for _ in range(2):
                assert (await client.post(path, json={})).status_code == 200
            full = await client.post(path, json={})
            assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_client_secrets"
            other = await client.post(path, json={}, headers=bearer(OTHER_KEY))
            assert other.status_code == 200  # the other tenant still mints
