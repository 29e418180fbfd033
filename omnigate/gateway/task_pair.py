"""A connection's reader and writer run together; whichever ends first ends the other."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def run_reader_writer(reader: Coroutine[Any, Any, None], writer: Coroutine[Any, Any, None], name: str) -> None:
    """Run both to the first exit, then cancel the other and wait for both, so no task outlives the connection."""
    tasks = (
        asyncio.create_task(reader, name=f"{name}-reader"),
        asyncio.create_task(writer, name=f"{name}-writer"),
    )
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
