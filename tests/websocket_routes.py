"""Every WebSocket route of the gateway, served with an engine behind each (for checks that must cover them all)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.routing import WebSocketRoute

from omnigate.gateway.settings import Settings
from tests.serving import RunningServer, serve

MEDIA_ROUTES = frozenset(
    {
        "/v1/audio/speech/stream",
        "/v1/realtime",
        "/v1/duplex",
        "/v1/realtime/video",
        "/v1/realtime/robot/openpi",
        "/v1/video/chat/stream",
    }
)


@contextmanager
def serve_every_engine() -> Iterator[RunningServer]:
    """Speech (synthetic), duplex, video, robot policy and omni (the tiny random-weight presets) engines, one
    session each."""
    settings = Settings(
        engine="synthetic",
        duplex_model="preset:tiny",
        duplex_options={"max_sessions": "1"},
        video_model="preset:tiny",
        video_options={"max_sessions": "1"},
        robot_model="preset:tiny",
        robot_options={"max_sessions": "1", "threads": "1"},
        omni_model="preset:tiny",
        omni_options={"max_sessions": "1"},
    )
    with serve(settings) as server:
        yield server


def websocket_paths(server: RunningServer) -> list[str]:
    """The path of every WebSocket route the app serves; it includes every media route."""
    paths = sorted(route.path for route in server.app.routes if isinstance(route, WebSocketRoute))
    assert set(paths) >= MEDIA_ROUTES
    return paths
