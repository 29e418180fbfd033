"""The gateway side of duplex sessions on an engine core: a :class:`DuplexMirror` on a connection of its own.

:func:`connect_duplex_core` waits for the core to answer (it may still be loading the model), then a reader task
files the core's frames with the mirror. What the mirror sends goes out in one write per turn of the event loop,
never waiting on the socket: it is bounded by the sessions' input caps and credit. When the connection drops (the
core exited or crashed), the mirror ends its sessions with ``engine_unavailable`` and refuses new ones, typed,
while the client connects again to the core the supervisor restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from omnigate.engines.core.duplex_mirror import DuplexMirror
from omnigate.engines.core.duplex_protocol import DuplexInfo
from omnigate.engines.core.framing import FrameKind
from omnigate.engines.core.link import Connection, first_hello, hello_again, read_frames

log = logging.getLogger(__name__)


class CoreDuplexClient(DuplexMirror):
    """The duplex engine of an engine core, as the gateway's realtime sessions use it."""

    def __init__(
        self, socket_path: str, connection: Connection, hello: DuplexInfo, *, poll_interval_s: float = 0.5
    ) -> None:
        super().__init__(hello, self._queue)
        self._path = socket_path
        self._poll_interval_s = poll_interval_s
        self._writer: asyncio.StreamWriter | None = None
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._task = asyncio.get_running_loop().create_task(self._run(connection), name="duplex-core-client")

    async def aclose(self) -> None:
        """Close every session and the connection."""
        self.shutdown()
        self._flush()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # ---- internals ----------------------------------------------------------------------------------------------

    def _queue(self, data: bytes) -> None:
        if self._writer is None:
            return  # the sessions were ended when the connection dropped
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if out and self._writer is not None:
            with contextlib.suppress(ConnectionError, OSError):  # the reader sees the loss
                self._writer.write(b"".join(out))

    async def _run(self, connection: Connection) -> None:
        while True:
            self._writer = connection[1]
            try:
                reason = await read_frames(connection, self.receive)
            finally:
                self._writer = None
                self._out.clear()
            log.error("duplex sessions lost their engine core: %s", reason)
            self.lost(reason)
            connection, hello = await hello_again(
                self._path,
                FrameKind.DUPLEX_HELLO,
                FrameKind.DUPLEX_INFO,
                DuplexInfo,
                poll_interval_s=self._poll_interval_s,
            )
            log.info("duplex sessions attached to the engine core again")
            self.attached(hello)


async def connect_duplex_core(
    socket_path: str, *, ready_timeout_s: float = 600.0, poll_interval_s: float = 0.5
) -> CoreDuplexClient:
    """The duplex engine of the core at ``socket_path``, once it answers (within ``ready_timeout_s``: it may still
    be loading the model). Raises ``TimeoutError``."""
    connection, hello = await first_hello(
        socket_path,
        FrameKind.DUPLEX_HELLO,
        FrameKind.DUPLEX_INFO,
        DuplexInfo,
        ready_timeout_s=ready_timeout_s,
        poll_interval_s=poll_interval_s,
    )
    return CoreDuplexClient(socket_path, connection, hello, poll_interval_s=poll_interval_s)
