"""The engine core's socket server: a :class:`ReplicaCore` (one in-process engine pool) served to gateway
processes over a Unix socket.

Each gateway process holds one connection. A stream call is a task that forwards the core's stream messages as
frames; a CANCEL frame, or the connection closing (the gateway exited or crashed), cancels the task, which aborts
the stream in the pool and frees its slot at once. CONTROL and STATS are answered in order on the connection.
Writes wait for the socket to drain, so a gateway that stops reading stalls only its own calls, and what waits
for it is bounded by the credit its streams were granted. The frames queued in one turn of the event loop (one
engine step's outputs for every stream of the connection) leave in one write. When the core's engine is a duplex
engine, a connection also serves duplex sessions (``DUPLEX_*`` frames, :class:`DuplexLink`, whose writes never wait);
when it answers conversations itself, their answers (``ANSWER_*`` frames, :class:`AnswerLink`, the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from omnigate.engines.core.answer_server import AnswerLink
from omnigate.engines.core.duplex_server import DuplexLink
from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind, encode_frame
from omnigate.engines.remote.replica import ReplicaCore

if TYPE_CHECKING:
    from omnigate.engines.answering import AnsweringEngine
    from omnigate.engines.duplex.engine import DuplexEngine

log = logging.getLogger(__name__)

READ_BYTES = 256 * 1024


class CoreConnection:
    """One gateway process's connection to the core."""

    def __init__(
        self,
        core: ReplicaCore,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        duplex: DuplexEngine | None = None,
        answering: AnsweringEngine | None = None,
    ) -> None:
        self._core = core
        self._duplex_engine = duplex
        self._duplex: DuplexLink | None = None
        self._answering = answering
        self._answers: AnswerLink | None = None
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder()
        # one task per live stream call, by call id; bounded by the core's slots (others are refused at once)
        self._streams: dict[int, asyncio.Task[None]] = {}
        # frames queued this loop turn, written together at its end; bounded by what the calls may send in a turn
        self._outgoing: list[bytes] = []
        self._flush_scheduled = False

    async def serve(self) -> None:
        try:
            while data := await self._reader.read(READ_BYTES):
                for frame in self._decoder.feed(data):
                    await self._dispatch(frame)
        except FrameError as exc:
            log.warning("dropping a gateway connection: %s", exc)
        except (ConnectionError, OSError):
            pass
        finally:
            if self._duplex is not None:
                self._duplex.close()
            if self._answers is not None:
                self._answers.close()
            tasks = list(self._streams.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()

    def disconnect(self) -> None:
        """Drop the connection (the core is stopping): :meth:`serve` ends its calls and returns."""
        self._writer.transport.abort()

    async def _dispatch(self, frame: Frame) -> None:
        if frame.kind >= FrameKind.ANSWER_HELLO:
            self._answer_link().handle(frame)
        elif frame.kind >= FrameKind.DUPLEX_HELLO:
            self._duplex_link().handle(frame)
        elif frame.kind is FrameKind.OPEN:
            if frame.call in self._streams:
                raise FrameError(f"call {frame.call} is already open")
            task = asyncio.get_running_loop().create_task(self._stream(frame.call, frame.body), name="core-stream")
            self._streams[frame.call] = task
        elif frame.kind is FrameKind.CANCEL:
            running = self._streams.get(frame.call)
            if running is not None:
                # Waited for, so that whatever the gateway sends next sees the slot already free.
                running.cancel()
                await asyncio.wait({running})
        elif frame.kind is FrameKind.CONTROL:
            await self._unary(frame.call, self._core.control(frame.body))
        elif frame.kind is FrameKind.STATS:
            await self._unary(frame.call, self._core.stats(frame.body.decode()))
        else:
            raise FrameError(f"a gateway may not send {frame.kind.name}")

    def _duplex_link(self) -> DuplexLink:
        if self._duplex is None:
            if self._duplex_engine is None:
                raise FrameError("this engine core serves no duplex engine")
            transport = self._writer.transport
            self._duplex = DuplexLink(self._duplex_engine, self._writer.write, transport.get_write_buffer_size)
        return self._duplex

    def _answer_link(self) -> AnswerLink:
        if self._answers is None:
            if self._answering is None:
                raise FrameError("this engine core serves no engine that answers conversations")
            transport = self._writer.transport
            self._answers = AnswerLink(self._answering, self._writer.write, transport.get_write_buffer_size)
        return self._answers

    async def _unary(self, call: int, reply: Awaitable[bytes]) -> None:
        try:
            body = await reply
        except Exception as exc:
            log.exception("engine core call failed")
            await self._send(FrameKind.ERROR, call, f"{type(exc).__name__}: {exc}".encode())
            return
        await self._send(FrameKind.REPLY, call, body)

    async def _stream(self, call: int, request: bytes) -> None:
        messages = self._core.stream(request)
        try:
            async for message in messages:
                await self._send(FrameKind.STREAM, call, message)
            await self._send(FrameKind.END, call)
        except (ConnectionError, OSError):
            pass  # the gateway is gone; serve() cancels the rest
        except Exception as exc:
            log.exception("engine core stream failed")
            with contextlib.suppress(ConnectionError, OSError):
                await self._send(FrameKind.ERROR, call, f"{type(exc).__name__}: {exc}".encode())
        finally:
            await messages.aclose()  # aborts the stream in the pool if it is still open: the slot is freed
            self._streams.pop(call, None)

    async def _send(self, kind: FrameKind, call: int, body: bytes = b"") -> None:
        self._outgoing.append(encode_frame(kind, call, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        await self._writer.drain()

    def _flush(self) -> None:
        self._flush_scheduled = False
        frames, self._outgoing = self._outgoing, []
        if frames and not self._writer.is_closing():
            self._writer.write(b"".join(frames))


async def serve_core(
    core: ReplicaCore,
    socket_path: str,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    duplex: DuplexEngine | None = None,
    answering: AnsweringEngine | None = None,
) -> None:
    """Serve ``core`` on ``socket_path`` until ``stop`` is set (``ready`` is set once it listens), the duplex
    sessions of ``duplex``, the core's engine when it is a duplex engine, and the answers of ``answering``, when it
    answers conversations itself. The socket is readable by this user only."""
    connections: dict[CoreConnection, asyncio.Task[None]] = {}

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connection = CoreConnection(core, reader, writer, duplex, answering)
        connections[connection] = task
        try:
            await connection.serve()
        finally:
            connections.pop(connection, None)

    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    old_umask = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(accept, socket_path, limit=READ_BYTES)
    finally:
        os.umask(old_umask)
    log.info("engine core %s serving on %s", core.replica, socket_path)
    if ready is not None:
        ready.set()
    async with server:
        await stop.wait()
        server.close()
        tasks = list(connections.values())
        for connection in list(connections):
            connection.disconnect()
        await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
