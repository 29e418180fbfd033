"""A connection's reader and writer run together; whichever ends first ends the other."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


async def park() -> None:
    """Wait until cancelled: a reader that has nothing left to read parks here until the writer, which still has
    the last events and the close frame to send, ends the connection (and so cancels it)."""
    await asyncio.get_running_loop().create_future()


async def run_reader_writer(
    reader: Coroutine[Any, Any, None], writer: Coroutine[Any, Any, None], name: str
) -> Exception | None:
    """Run both to the first exit, then cancel the other and wait for both, so no task outlives the connection.

    Returns the exception either side died of (logged here), so the caller can end its session with a typed error
    instead of leaving the client to guess; None when both ended normally.
    """
    tasks = (
        asyncio.create_task(reader, name=f"{name}-reader"),
        asyncio.create_task(writer, name=f"{name}-writer"),
    )
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failure: Exception | None = None
    for task, result in zip(tasks, results, strict=True):
        # A crash of either side would otherwise vanish: the client would only see its connection drop.
        if isinstance(result, Exception):
            log.error("%s failed", task.get_name(), exc_info=result)
            failure = failure or result
    return failure
