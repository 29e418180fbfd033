"""How the gateway reaches engine replicas, as two small interfaces the remote pool is written against.

:class:`ReplicaTransport` carries the three calls to one replica; :class:`ReplicaDirectory` lists the replicas
deployed now and connects to them. :mod:`omnigate.engines.remote.serve` implements both on Ray Serve.
A transport raises :class:`ReplicaUnavailable` when the replica is gone (dead, restarting, unreachable).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol


class ReplicaUnavailable(Exception):
    """The replica cannot be reached: its process died, it is restarting, or the call timed out."""


class ReplicaTransport(Protocol):
    def open_stream(self, request: bytes) -> AsyncGenerator[bytes, None]:
        """Start a streaming call; closing the iterator early cancels the call on the replica."""
        ...

    async def control(self, batch: bytes) -> bytes: ...

    async def stats(self, gateway: str) -> bytes:
        """The replica's state; naming the gateway renews the lease of its streams there."""
        ...


class ReplicaDirectory(Protocol):
    async def names(self) -> list[str]:
        """The replicas deployed now (the engine applications' names)."""
        ...

    async def connect(self, name: str) -> ReplicaTransport: ...
