"""A streamed HTTP response that ends cleanly only when its body is complete.

With chunked transfer, a body that ends with its terminating chunk is a complete body to every client. So a body
that could not be finished (the engine failed, the session was closed) is aborted instead: the connection is
closed without the terminating chunk, and clients see an incomplete read rather than a cut-off file saved as whole.
A client that accepts nothing for the stall timeout is dropped the same way, so it cannot hold its session and
engine stream for the session's maximum duration. (What the dropped connection had buffered, at most the socket's
send buffer and uvicorn's write buffer, stays with its file descriptor until the client reads or goes away: the
event loop's close waits for the flush, and ASGI does not hand a route the transport to abort.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from omnigate.gateway.task_pair import run_reader_writer

log = logging.getLogger(__name__)


class BodyAborted(Exception):
    """Raised by a body generator whose stream cannot be completed: the response is aborted, not finished."""


class _Stalled(Exception):
    pass


class AbortableStreamingResponse(Response):
    """A response streaming ``body`` (status 200), with a stall timeout on every send.

    ``on_end`` runs exactly once when the response is over, however it ended (completed, aborted, stalled, or the
    client went away, even before the body started).
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        *,
        media_type: str,
        headers: dict[str, str],
        stall_timeout_s: float,
        on_end: Callable[[], None],
    ) -> None:
        self.body_generator = body
        self.stall_timeout_s = stall_timeout_s
        self.on_end = on_end
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await run_reader_writer(self._wait_for_disconnect(receive), self._stream(send), "http-stream")
        finally:
            await self.body_generator.aclose()
            self.on_end()

    async def _wait_for_disconnect(self, receive: Receive) -> None:
        # The request body was read before the response began: what remains to receive is the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _stream(self, send: Send) -> None:
        try:
            await self._send(
                send, {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_generator:
                if chunk:
                    await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except BodyAborted as exc:
            # Returning without the last body message makes the server close the connection unterminated.
            log.warning("streamed response aborted: %s", exc)
        except _Stalled:
            log.info("closing a stalled HTTP client")

    async def _send(self, send: Send, message: Message | dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await send(message)
        except TimeoutError:
            raise _Stalled from None
