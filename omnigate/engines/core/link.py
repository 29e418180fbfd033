"""A gateway's own connection to the engine core for one kind of session (duplex sessions, realtime answers): the
hello that opens it, the wait for a core that is still loading its model, the reader loop, and the reconnection to
the core the supervisor restarts. The clients (:mod:`omnigate.engines.core.duplex_client`,
:mod:`omnigate.engines.core.answer_client`) keep what their sessions need of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from omnigate.engines.core.client import READ_BYTES
from omnigate.engines.core.framing import Frame, FrameDecoder, FrameError, FrameKind, decode_body, encode_frame

log = logging.getLogger(__name__)

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter, FrameDecoder]

_Info = TypeVar("_Info")


async def hello(
    socket_path: str, timeout_s: float, ask: FrameKind, answer: FrameKind, info: type[_Info]
) -> tuple[Connection, _Info]:
    """A new connection and the core's ``answer`` to ``ask``, decoded as ``info``. Raises OSError, TimeoutError,
    FrameError."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=READ_BYTES)
        try:
            writer.write(encode_frame(ask, 0))
            decoder = FrameDecoder()
            while data := await reader.read(READ_BYTES):
                frames = decoder.feed(data)
                if frames:
                    first = frames[0]
                    if first.kind is not answer or len(frames) > 1:
                        raise FrameError(f"the engine core answered {ask.name} with {first.kind.name}")
                    return (reader, writer, decoder), decode_body(first.body, info)
            raise ConnectionResetError("the engine core closed the connection")
        except BaseException:
            writer.close()
            raise


async def first_hello(
    socket_path: str,
    ask: FrameKind,
    answer: FrameKind,
    info: type[_Info],
    *,
    ready_timeout_s: float,
    poll_interval_s: float,
) -> tuple[Connection, _Info]:
    """:func:`hello` once the core answers (within ``ready_timeout_s``: it may still be loading the model). Raises
    ``TimeoutError``."""
    async with asyncio.timeout(ready_timeout_s):
        while True:
            try:
                return await hello(socket_path, max(1.0, 4 * poll_interval_s), ask, answer, info)
            except (OSError, TimeoutError, FrameError) as exc:
                log.debug("the engine core does not answer yet: %s", exc)
                await asyncio.sleep(poll_interval_s)


async def hello_again(
    socket_path: str, ask: FrameKind, answer: FrameKind, info: type[_Info], *, poll_interval_s: float
) -> tuple[Connection, _Info]:
    """:func:`hello` after the connection was lost, polling until the restarted core answers."""
    while True:
        await asyncio.sleep(poll_interval_s)
        try:
            return await hello(socket_path, max(1.0, 4 * poll_interval_s), ask, answer, info)
        except (OSError, TimeoutError, FrameError):
            continue


async def read_frames(connection: Connection, receive: Callable[[Frame], None]) -> str:
    """Hand every frame the core sends to ``receive`` until the connection ends; why it ended. The writer is
    closed on the way out."""
    reader, writer, decoder = connection
    try:
        while data := await reader.read(READ_BYTES):
            for frame in decoder.feed(data):
                receive(frame)
        return "the engine core closed the connection"
    except FrameError as exc:
        return f"the engine core broke the framing: {exc}"
    except (ConnectionError, OSError) as exc:
        return f"the engine core connection broke: {exc}"
    finally:
        writer.close()
