"""Event-loop lag: how late the server's loop wakes a task that asked to sleep a known time.

Every session's reads, writes and timers run on that one loop, so its lag is added to every chunk's delivery; a busy
loop (or a GIL held by engine threads) shows here before it shows as client underruns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.05


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
    """Pass the loop's lateness in seconds to ``observe`` (e.g. a histogram's) every ``interval_s`` until
    cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due))
