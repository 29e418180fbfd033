"""Media WebSockets are never compressed: a client at its defaults offers permessage-deflate and gets no extension.

Every WebSocket route of the app is checked, so a route added later is covered without editing this test. Chromium's
side of the same check is in ``tests/browser/test_ws_compression.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve as bare_serve
from websockets.extensions.permessage_deflate import PerMessageDeflate

from tests.serving import RunningServer
from tests.websocket_routes import serve_every_engine, websocket_paths

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def every_engine() -> Iterator[RunningServer]:
    with serve_every_engine() as server:
        yield server


async def test_a_default_websockets_client_offers_compression() -> None:
    """The control: the same client, against a server that accepts the offer, ends up compressed."""
    async with bare_serve(lambda ws: ws.wait_closed(), "127.0.0.1", 0) as bare:
        port = bare.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            assert "permessage-deflate" in (ws.request.headers.get("Sec-WebSocket-Extensions") or "")
            assert [type(ext) for ext in ws.protocol.extensions] == [PerMessageDeflate]


async def test_no_websocket_route_negotiates_compression(every_engine: RunningServer) -> None:
    routes = websocket_paths(every_engine)
    for path in routes:
        async with connect(f"{every_engine.ws_url}{path}") as ws:
            assert "permessage-deflate" in (ws.request.headers.get("Sec-WebSocket-Extensions") or "")
            assert ws.response.headers.get("Sec-WebSocket-Extensions") is None, path
            assert ws.protocol.extensions == [], path
