"""The event-loop lag watcher observes how late the loop wakes it."""

from __future__ import annotations

import asyncio
import contextlib
import time

from omnigate.gateway.ops.loop_lag import watch_loop_lag


async def test_a_blocked_loop_shows_as_lag() -> None:
    lags: list[float] = []
    observed = asyncio.Event()

    def observe(lag: float) -> None:
        lags.append(lag)
        observed.set()

    watcher = asyncio.create_task(watch_loop_lag(observe, interval_s=0.001))
    await asyncio.sleep(0)  # the watcher starts its first timed sleep
    time.sleep(0.05)  # noqa: ASYNC251 - the point: hold the loop past the watcher's wake-up time
    await observed.wait()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    assert lags[0] >= 0.04
