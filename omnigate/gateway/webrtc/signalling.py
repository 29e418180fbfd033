"""What every WebRTC call route shares (realtime, generated video, video chat): reading the SDP offer, admitting
the call through the session registry, answering the offer and starting the call, and the registry of live calls.

A route builds its own call object (anything of the :class:`Call` shape) between :func:`admit_call` and
:func:`answer_call`; nothing here knows the routes, so any route's module may import it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from aiortc.sdp import SessionDescription
from starlette.requests import Request
from starlette.responses import Response

from omnigate.gateway.errors import HttpError
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.gateway.webrtc.ice import configure_ice
from omnigate.gateway.webrtc.telemetry import WebRtcTelemetry
from omnigate.sessions.registry import SessionLease, SessionLimitReached

log = logging.getLogger(__name__)

SDP_MEDIA_TYPE = "application/sdp"


class Call(Protocol):
    """A call of any route: answered once, then served by :meth:`run` until it ends."""

    @property
    def call_id(self) -> str: ...

    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to the client's offer."""
        ...

    async def run(self) -> None:
        """Serve the call until it ends, then release everything it holds."""
        ...

    async def close(self) -> None:
        """Release everything (idempotent)."""
        ...

    def stop(self, reason: str) -> None:
        """End the call from outside (server shutdown)."""
        ...


class WebRtcCalls:
    """The live calls of one gateway: started here, and all closed when the server stops."""

    def __init__(self, settings: Settings, telemetry: WebRtcTelemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.calls: dict[str, Call] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._restore_ice: Callable[[], None] | None = None

    def configure(self) -> None:
        """Apply the process-wide ICE options (host candidate addresses, UDP port range) when they are set."""
        self._restore_ice = configure_ice(self.settings.webrtc_host_addresses, self.settings.webrtc_udp_ports)

    def start(self, call: Call) -> None:
        self.calls[call.call_id] = call
        task = asyncio.create_task(call.run(), name=f"webrtc-call-{call.call_id}")
        self._tasks.add(task)

        def forget(done: asyncio.Task[None]) -> None:
            self._tasks.discard(done)
            self.calls.pop(call.call_id, None)

        task.add_done_callback(forget)

    async def join(self) -> None:
        """Wait until the calls live now have ended (each ends by itself: session end, disconnect, timeouts)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close_all(self, timeout_s: float = 5.0) -> None:
        """End every call with ``shutting_down``, wait for their peer connections to close, undo :meth:`configure`."""
        for call in list(self.calls.values()):
            call.stop("shutting_down")
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._restore_ice is not None:
            self._restore_ice()
            self._restore_ice = None


def admit_call(gateway: Gateway, transport: str) -> SessionLease:
    """A session lease for a new call, or a typed 503 (``server_busy``, ``shutting_down``)."""
    try:
        return gateway.registry.acquire(transport)
    except SessionLimitReached as exc:
        code = "shutting_down" if exc.draining else "server_busy"
        raise HttpError(503, str(exc), code=code, retry_after_s=exc.retry_after_s) from None


async def answer_call(call: Call, offer: str, calls: WebRtcCalls, path: str) -> Response:
    """Answer the offer and start serving the call (201), or close it and refuse the offer (400)."""
    try:
        answer = await call.answer(offer)
    except Exception as exc:
        await call.close()
        log.info("WebRTC offer refused: %s: %s", type(exc).__name__, exc)
        return HttpError(400, f"the offer could not be answered: {exc}", code="invalid_offer").response()
    calls.start(call)
    return Response(
        answer,
        status_code=201,
        media_type=SDP_MEDIA_TYPE,
        headers={"Location": f"{path}/{call.call_id}"},
    )


async def read_offer(request: Request, limit: int, kind: str = "audio") -> str:
    """The offer SDP, checked for the one thing every call needs: a ``kind`` section we may send on."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != SDP_MEDIA_TYPE:
        raise HttpError(415, f"send the SDP offer as {SDP_MEDIA_TYPE}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"offer over {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"offer over {limit} bytes", code="request_too_large")
    try:
        text = body.decode("utf-8")
        parsed = SessionDescription.parse(text)
    # aiortc's parser signals some malformed lines (a media line without a numeric port) with AssertionError.
    except (UnicodeDecodeError, ValueError, IndexError, KeyError, AssertionError) as exc:
        raise HttpError(400, f"the body is not an SDP offer: {exc}", code="invalid_offer") from None
    sections = [m for m in parsed.media if m.kind == kind]
    if not sections:
        raise HttpError(
            400, f"the offer has no {kind} section; add a transceiver of kind {kind!r}", code="invalid_offer"
        )
    if not any(m.direction in (None, "sendrecv", "recvonly") for m in sections):
        raise HttpError(
            400, f"the offer's {kind} section does not receive (sendonly or inactive)", code="invalid_offer"
        )
    return text
