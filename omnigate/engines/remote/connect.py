"""Join a Ray cluster from a gateway process and start a remote engine pool over its engine replicas."""

from __future__ import annotations

import asyncio

from omnigate.engines.remote.admin import connect
from omnigate.engines.remote.pool import RemoteEnginePool
from omnigate.engines.remote.serve import ServeDirectory


async def connect_ray_pool(
    address: str | None, prefix: str, *, retry_after_s: float = 1.0, ready_timeout_s: float = 60.0
) -> RemoteEnginePool:
    """Join the cluster at ``address`` and wait until an engine replica named ``PREFIX-N`` answers."""
    await asyncio.to_thread(connect, address)
    pool = RemoteEnginePool(ServeDirectory(prefix), retry_after_s=retry_after_s)
    await pool.start(ready_timeout_s)
    return pool
