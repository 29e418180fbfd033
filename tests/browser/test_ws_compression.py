"""Chromium at its defaults offers permessage-deflate; no WebSocket route of the gateway accepts it.

A WebSocket needs no ICE, so this test runs Chromium on loopback (no network namespace). The control is a bare
``websockets`` server at its defaults, which accepts the offer: the same page sees the extension there.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.server import serve as bare_serve

from tests.serving import RunningServer
from tests.websocket_routes import serve_every_engine, websocket_paths

pytestmark = pytest.mark.browser

SCRIPT = Path(__file__).with_name("ws_extensions.mjs")
NODE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def every_engine() -> Iterator[RunningServer]:
    with serve_every_engine() as server:
        yield server


async def negotiated_in_chromium(page_url: str, urls: list[str]) -> dict[str, object]:
    node = await asyncio.create_subprocess_exec(
        "node", str(SCRIPT), page_url, *urls, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(node.communicate(), NODE_TIMEOUT_S)
    assert node.returncode == 0, stderr.decode()[-3000:]
    result: dict[str, object] = json.loads(stdout)
    return result


async def test_chromium_gets_no_extension_on_any_websocket_route(every_engine: RunningServer) -> None:
    routes = websocket_paths(every_engine)
    async with bare_serve(lambda ws: ws.wait_closed(), "127.0.0.1", 0) as bare:
        control = f"ws://127.0.0.1:{bare.sockets[0].getsockname()[1]}/"
        urls = [f"{every_engine.ws_url}{path}" for path in routes]
        negotiated = await negotiated_in_chromium(f"{every_engine.http_url}/health", [control, *urls])
    offered = negotiated.pop(control)
    assert isinstance(offered, str) and offered.startswith("permessage-deflate"), offered
    assert negotiated == dict.fromkeys(urls, "")
