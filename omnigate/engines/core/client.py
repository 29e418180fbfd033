"""The gateway side of the engine-core socket: a :class:`ReplicaTransport` and :class:`ReplicaDirectory` for the
remote engine pool, so a gateway process serves an engine core exactly as it serves Ray replicas.

One connection per gateway process, opened on first use and again after it is lost. A reader task files each
frame with its call: stream messages into the call's inbox, replies into its future. When the connection drops
(the core exited or crashed), every open call raises :class:`ReplicaUnavailable`: the pool ends live streams with a
typed ``engine_unavailable`` error and reports itself unhealthy until a stats call reaches the core again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator

from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind, encode_frame
from omnigate.engines.remote.pool import RemoteEnginePool
from omnigate.engines.remote.transport import ReplicaUnavailable

log = logging.getLogger(__name__)

CORE_NAME = "engine-core"
READ_BYTES = 256 * 1024
# The core sends a stream no more than its credit allows plus its markers, and the session grants credit only as
# it drains what it received; an inbox this deep means a broken peer, and the call fails instead of growing.
MAX_INBOX_MESSAGES = 4096


class _Inbox:
    """A stream call's messages not yet read; ``None`` marks its end."""

    def __init__(self) -> None:
        self.items: collections.deque[bytes | None] = collections.deque()
        self.error: Exception | None = None
        self.wake = asyncio.Event()

    def put(self, item: bytes | None) -> None:
        if len(self.items) >= MAX_INBOX_MESSAGES:
            self.fail(ReplicaUnavailable("the engine core sent a stream more than its credit allows"))
            return
        self.items.append(item)
        self.wake.set()

    def fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.wake.set()

    async def get(self) -> bytes | None:
        while not self.items:
            if self.error is not None:
                raise self.error
            self.wake.clear()
            await self.wake.wait()
        return self.items.popleft()


class CoreTransport:
    """Calls to the engine core over its Unix socket."""

    def __init__(self, socket_path: str, *, connect_timeout_s: float = 5.0) -> None:
        self._path = socket_path
        self._connect_timeout_s = connect_timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self._inboxes: dict[int, _Inbox] = {}
        self._replies: dict[int, asyncio.Future[bytes]] = {}

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def open_stream(self, request: bytes) -> AsyncGenerator[bytes, None]:
        writer = await self._connection()
        call = next(self._ids)
        inbox = self._inboxes[call] = _Inbox()
        ended = False
        try:
            await self._write(writer, encode_frame(FrameKind.OPEN, call, request))
            while (item := await inbox.get()) is not None:
                yield item
            ended = True
        finally:
            self._inboxes.pop(call, None)
            if not ended and inbox.error is None and self._writer is writer:
                # Given up early (abort, or the stream's session ended): the core aborts it and frees the slot.
                with contextlib.suppress(ConnectionError, OSError):
                    writer.write(encode_frame(FrameKind.CANCEL, call))

    async def control(self, batch: bytes) -> bytes:
        return await self._unary(FrameKind.CONTROL, batch)

    async def stats(self, gateway: str) -> bytes:
        return await self._unary(FrameKind.STATS, gateway.encode())

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task

    # ---- internals --------------------------------------------------------------------------------------------

    async def _unary(self, kind: FrameKind, body: bytes) -> bytes:
        writer = await self._connection()
        call = next(self._ids)
        reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._replies[call] = reply
        try:
            await self._write(writer, encode_frame(kind, call, body))
            return await reply
        finally:
            self._replies.pop(call, None)

    async def _write(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        try:
            writer.write(frame)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            raise ReplicaUnavailable(f"the engine core connection broke: {exc}") from exc

    async def _connection(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                try:
                    async with asyncio.timeout(self._connect_timeout_s):
                        reader, writer = await asyncio.open_unix_connection(self._path, limit=READ_BYTES)
                except (OSError, TimeoutError) as exc:
                    raise ReplicaUnavailable(f"the engine core at {self._path} is not reachable: {exc}") from exc
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(
                    self._read(reader, writer), name="engine-core-reader"
                )
            return self._writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        reason = "the engine core closed the connection"
        try:
            while data := await reader.read(READ_BYTES):
                for frame in decoder.feed(data):
                    self._file(frame)
        except FrameError as exc:
            reason = f"the engine core broke the framing: {exc}"
            log.error("%s", reason)
        except (ConnectionError, OSError) as exc:
            reason = f"the engine core connection broke: {exc}"
        finally:
            self._writer = None
            writer.close()
            lost = ReplicaUnavailable(reason)
            for inbox in self._inboxes.values():
                inbox.fail(lost)
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(lost)

    def _file(self, frame: Frame) -> None:
        if frame.kind is FrameKind.STREAM or frame.kind is FrameKind.END:
            inbox = self._inboxes.get(frame.call)
            if inbox is not None:  # otherwise cancelled here already: the core drops it too
                inbox.put(frame.body if frame.kind is FrameKind.STREAM else None)
        elif frame.kind is FrameKind.REPLY:
            reply = self._replies.get(frame.call)
            if reply is not None and not reply.done():
                reply.set_result(frame.body)
        elif frame.kind is FrameKind.ERROR:
            error = RuntimeError(f"engine core: {frame.body.decode(errors='replace')}")
            inbox = self._inboxes.get(frame.call)
            if inbox is not None:
                inbox.fail(error)
            reply = self._replies.get(frame.call)
            if reply is not None and not reply.done():
                reply.set_exception(error)
        else:
            raise FrameError(f"the engine core may not send {frame.kind.name}")


class CoreDirectory:
    """The one engine core a gateway process is attached to, as a directory of one replica."""

    def __init__(self, socket_path: str) -> None:
        self.transport = CoreTransport(socket_path)

    async def names(self) -> list[str]:
        return [CORE_NAME]

    async def connect(self, name: str) -> CoreTransport:
        return self.transport


async def connect_core_pool(
    socket_path: str, *, retry_after_s: float = 1.0, ready_timeout_s: float = 600.0, poll_interval_s: float = 0.5
) -> tuple[RemoteEnginePool, CoreTransport]:
    """A remote pool over the engine core at ``socket_path``, once the core answers (it may still be loading its
    engine: up to ``ready_timeout_s``), and its transport (close it after the pool). Raises ``TimeoutError``."""
    directory = CoreDirectory(socket_path)
    pool = RemoteEnginePool(directory, retry_after_s=retry_after_s, poll_interval_s=poll_interval_s)
    try:
        await pool.start(ready_timeout_s)
    except BaseException:
        await directory.transport.close()
        raise
    return pool, directory.transport
