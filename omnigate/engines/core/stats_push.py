"""An engine's counters pushed from the core to a gateway connection: at most once a second, and only when changed.

The gateway keeps the last copy it received (its ``/metrics`` reads it); a connection whose gateway is not reading
(its unsent output past :data:`STATS_BACKLOG_BYTES`) gets the next change at a later interval instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec

from omnigate.engines.core.framing import FrameKind, encode_frame

STATS_INTERVAL_S = 1.0
STATS_BACKLOG_BYTES = 1024 * 1024

_ENCODER = msgspec.msgpack.Encoder()


async def push_stats(stats: object, kind: FrameKind, send: Callable[[bytes], None], backlog: Callable[[], int]) -> None:
    """Send ``stats`` (a dataclass or struct the core updates in place) as ``kind`` frames (call 0) until
    cancelled."""
    last = b""
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        body = _ENCODER.encode(stats)
        if body != last and backlog() < STATS_BACKLOG_BYTES:
            last = body
            with contextlib.suppress(ConnectionError, OSError):
                send(encode_frame(kind, 0, body))
