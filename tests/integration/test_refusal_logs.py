"""A refused WebSocket is logged once, as a refusal, by the real ``omnigate serve``: uvicorn's "ASGI callable returned
without completing handshake" error, which it writes for every denial response, is filtered out."""

from __future__ import annotations

from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.integration.agent_pipelines import omnigate_serve

pytestmark = pytest.mark.integration

ROUTES = ("/v1/audio/speech/stream", "/v1/realtime", "/v1/realtime/video")


async def test_refused_websockets_log_their_refusal_and_no_handshake_error(tmp_path: Path) -> None:
    with omnigate_serve(tmp_path, "--api-key", "sk-test", engine="synthetic") as server:
        for route in ROUTES:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(server.base_url.replace("http", "ws") + route):
                    pass
            assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus):  # an unknown route is refused by the router (403 before accept)
            async with connect(server.base_url.replace("http", "ws") + "/v1/nowhere"):
                pass
    log = server.log.read_text()
    assert all(f"refused websocket {route}: missing_api_key" in log for route in ROUTES), log
    assert "without completing handshake" not in log, log
