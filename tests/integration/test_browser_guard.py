"""Without authentication on loopback, web pages other than the server's own cannot use it (nor rebind to it).

Each refusal is typed: OpenAI's error shape over HTTP, an HTTP 403 before any accept for a WebSocket. The server's
own pages, clients that send no ``Origin`` (SDKs, curl) and ``--allow-origin`` origins keep working.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from omnigate.gateway.cli.serve import build_parser, settings_from_args
from omnigate.gateway.security.credentials import api_key_hash
from omnigate.gateway.settings import Settings
from tests.serving import RunningServer, serve

SPEECH = "/v1/audio/speech"
STREAM = "/v1/audio/speech/stream"
ALLOWED = "http://app.example:3000"
EVIL = "http://evil.example"
REQUEST = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "pcm"}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve(Settings(engine="synthetic", allowed_origins=(ALLOWED,))) as running:
        yield running


def assert_refused(response: httpx.Response, code: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "permission_error" and error["message"]


async def test_a_rebound_host_name_is_refused_on_every_route(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        for path in ("/v1/models", "/", "/health"):
            assert_refused(await client.get(path, headers={"host": "evil.example"}), "host_not_allowed")
        assert_refused(await client.post(SPEECH, json=REQUEST, headers={"host": "rebind.evil.example:8000"}),
                       "host_not_allowed")  # fmt: skip
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "app.localhost"):
            assert (await client.get("/v1/models", headers={"host": host})).status_code == 200
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.ws_url + STREAM, additional_headers={"host": "evil.example"})
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body)["error"]["code"] == "host_not_allowed"


async def test_a_foreign_page_cannot_use_the_server(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        assert_refused(await client.post(SPEECH, json=REQUEST, headers={"origin": EVIL}), "origin_not_allowed")
        assert_refused(await client.get("/v1/audio/voices", headers={"origin": "null"}), "origin_not_allowed")
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.ws_url + STREAM, origin=EVIL)  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body)["error"]["code"] == "origin_not_allowed"


async def test_the_servers_own_pages_clients_without_origin_and_allowed_origins_are_served(
    server: RunningServer,
) -> None:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        own = {"origin": server.http_url}
        assert (await client.get("/", headers=own)).status_code == 200
        assert (await client.post(SPEECH, json=REQUEST, headers=own)).status_code == 200
        assert (await client.post(SPEECH, json=REQUEST)).status_code == 200  # an SDK sends no Origin
        # An allowed origin's page gets through the CORS preflight and may read the answer.
        preflight = await client.options(
            SPEECH, headers={"origin": ALLOWED, "access-control-request-method": "POST",
                             "access-control-request-headers": "content-type"},
        )  # fmt: skip
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == ALLOWED
        assert "content-type" in preflight.headers["access-control-allow-headers"]
        allowed = await client.post(SPEECH, json=REQUEST, headers={"origin": ALLOWED})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    for origin in (server.http_url, ALLOWED):
        async with connect(server.ws_url + STREAM, origin=origin) as ws:  # type: ignore[arg-type]
            await ws.send(json.dumps({"type": "session.config"}))


async def test_speech_requires_a_json_body(server: RunningServer) -> None:
    # A page may POST text/plain or a form anywhere without a preflight; JSON it may not.
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            response = await client.post(SPEECH, content=json.dumps(REQUEST), headers=headers)
            assert response.status_code == 415
            assert response.json()["error"]["code"] == "unsupported_media_type"
        charset = {"content-type": "application/json; charset=utf-8"}
        assert (await client.post(SPEECH, content=json.dumps(REQUEST), headers=charset)).status_code == 200


async def test_with_an_api_key_pages_of_any_origin_that_hold_a_key_are_served() -> None:
    with serve(Settings(engine="synthetic", api_key_hashes=(api_key_hash("sk-test"),))) as keyed:
        async with httpx.AsyncClient(base_url=keyed.http_url) as client:
            headers = {"origin": EVIL, "authorization": "Bearer sk-test"}
            assert (await client.post(SPEECH, json=REQUEST, headers=headers)).status_code == 200


def test_allow_origin_is_a_repeatable_serve_option() -> None:
    args = build_parser().parse_args(["serve", "--allow-origin", ALLOWED, "--allow-origin", "https://b.example"])
    assert settings_from_args(args).allowed_origins == (ALLOWED, "https://b.example")
