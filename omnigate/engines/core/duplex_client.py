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

from omnigate.engines.core.client import READ_BYTES
from omnigate.engines.core.duplex_mirror import DuplexMirror
from omnigate.engines.core.duplex_protocol import DuplexInfo, decode_body
from omnigate.engines.core.framing import FrameDecoder, FrameError, FrameKind, encode_frame

log = logging.getLogger(__name__)

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter, FrameDecoder]


async def _hello(socket_path: str, timeout_s: float) -> tuple[Connection, DuplexInfo]:
    """A new duplex connection and the core's answer to DUPLEX_HELLO. Raises OSError, TimeoutError, FrameError."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=READ_BYTES)
        try:
            writer.write(encode_frame(FrameKind.DUPLEX_HELLO, 0))
            decoder = FrameDecoder()
            while data := await reader.read(READ_BYTES):
                frames = decoder.feed(data)
                if frames:
                    first = frames[0]
                    if first.kind is not FrameKind.DUPLEX_INFO or len(frames) > 1:
                        raise FrameError(f"the engine core answered DUPLEX_HELLO with {first.kind.name}")
                    return (reader, writer, decoder), decode_body(first.body, DuplexInfo)
            raise ConnectionResetError("the engine core closed the connection")
        except BaseException:
            writer.close()
            raise


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
            reason = await self._serve(connection)
            log.error("duplex sessions lost their engine core: %s", reason)
            self.lost(reason)
            connection = await self._reconnect()

    async def _serve(self, connection: Connection) -> str:
        reader, writer, decoder = connection
        self._writer = writer
        try:
            while data := await reader.read(READ_BYTES):
                for frame in decoder.feed(data):
                    self.receive(frame)
            return "the engine core closed the connection"
        except FrameError as exc:
            return f"the engine core broke the framing: {exc}"
        except (ConnectionError, OSError) as exc:
            return f"the engine core connection broke: {exc}"
        finally:
            self._writer = None
            self._out.clear()
            writer.close()

    async def _reconnect(self) -> Connection:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                connection, hello = await _hello(self._path, max(1.0, 4 * self._poll_interval_s))
            except (OSError, TimeoutError, FrameError):
                continue
            log.info("duplex sessions attached to the engine core again")
            self.attached(hello)
            return connection


async def connect_duplex_core(
    socket_path: str, *, ready_timeout_s: float = 600.0, poll_interval_s: float = 0.5
) -> CoreDuplexClient:
    """The duplex engine of the core at ``socket_path``, once it answers (within ``ready_timeout_s``: it may still
    be loading the model). Raises ``TimeoutError``."""
    async with asyncio.timeout(ready_timeout_s):
        while True:
            try:
                connection, hello = await _hello(socket_path, max(1.0, 4 * poll_interval_s))
            except (OSError, TimeoutError, FrameError) as exc:
                log.debug("the engine core does not answer yet: %s", exc)
                await asyncio.sleep(poll_interval_s)
                continue
            return CoreDuplexClient(socket_path, connection, hello, poll_interval_s=poll_interval_s)
