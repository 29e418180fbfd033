"""The server fuzzing runs against: the real gateway with the synthetic engine, and a watch on its error log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from omnigate.gateway.settings import Settings
from tests.fuzz.harness import ServerErrors
from tests.serving import RunningServer, serve


def fuzz_settings() -> Settings:
    """Default limits except the frame limit (so an oversized frame is cheap to send), little audio per character
    (so fuzzed utterances are cheap to speak), the tiny video model with a pixel budget of 32x32x9 (so every
    clip it admits takes a fraction of a second), the tiny omni model (video chat's pictures) and the tiny robot
    policy."""
    return Settings(
        engine="synthetic",
        model="ms_per_char=2",
        ws_max_message_bytes=256 * 1024,
        config_timeout_s=600.0,
        idle_timeout_s=600.0,
        video_model="preset:tiny",
        video_options={"max_sessions": "2", "max_video_pixels": str(32 * 32 * 9)},
        omni_model="preset:tiny",
        robot_model="preset:tiny",
        robot_options={"threads": "1"},
    )


@contextmanager
def fuzz_server(settings: Settings | None = None) -> Iterator[tuple[RunningServer, ServerErrors]]:
    """The server, and the unhandled errors it logs while it runs."""
    errors = ServerErrors()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with serve(settings or fuzz_settings()) as server:
            yield server, errors
    finally:
        for logger in loggers:
            logger.removeHandler(errors)


def routes(server: RunningServer) -> frozenset[str]:
    return frozenset(path for route in server.app.routes if isinstance(path := getattr(route, "path", None), str))


async def settle(server: RunningServer, limit_s: float = 30.0) -> None:
    """Until the server holds no session and no engine stream (fails after ``limit_s``)."""
    pool = server.gateway.pool
    assert pool is not None

    def idle() -> bool:
        return server.gateway.registry.total_active == 0 and pool.active == 0

    await _until(server, idle, limit_s)


async def _until(server: RunningServer, predicate: Callable[[], bool], limit_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not server.call(predicate):
        assert loop.time() < deadline, "the server still holds sessions or engine streams"
        await asyncio.sleep(0.05)
