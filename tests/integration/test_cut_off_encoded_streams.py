"""Clients that hang up in the middle of an encoded stream (a barge-in over ``POST /v1/audio/speech`` with the mp3
LiveKit's and the OpenAI SDK's clients ask for by default) leave the real server running: a codec still encoding in
its worker thread is never closed under it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.agent_pipelines import omnigate_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEXT = "This sentence is long enough to take a while to encode. And here is another one, for good measure."


@pytest.mark.parametrize("response_format", ["mp3", "opus"])
async def test_hanging_up_mid_stream_leaves_the_server_serving(tmp_path: Path, response_format: str) -> None:
    with omnigate_serve(tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            for _ in range(12):
                body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": response_format}
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    assert response.status_code == 200
                    async for _chunk in response.aiter_bytes():
                        break  # hang up after the first bytes
            assert (await client.get("/ready")).status_code == 200
        assert server.process.poll() is None, server.log.read_text()
