"""The video routes' receive timeout: the idle timeout only while no video is being generated."""

from __future__ import annotations

import asyncio

from omnigate.gateway.settings import Settings
from omnigate.gateway.video.generation import rearm_receive_timeout


async def test_the_idle_timer_is_off_while_a_video_is_generated_and_restarts_after() -> None:
    settings = Settings(idle_timeout_s=5.0)
    loop = asyncio.get_running_loop()
    session_deadline = loop.time() + 100.0
    async with asyncio.timeout(None) as timeout:  # noqa: ASYNC100 - entered only to be rescheduled
        rearm_receive_timeout(timeout, session_deadline, True, settings)
        assert timeout.when() == session_deadline
        before = loop.time()
        rearm_receive_timeout(timeout, session_deadline, False, settings)
        when = timeout.when()
        assert when is not None and before + 5.0 <= when <= loop.time() + 5.0
        rearm_receive_timeout(timeout, before + 1.0, False, settings)
        assert timeout.when() == before + 1.0  # the session's end comes first
