"""``POST /v1/realtime/calls``: an SDP offer in (``application/sdp``), the SDP answer out, as OpenAI's WebRTC flow.
``POST /v1/realtime/video/calls``: the same for generated video (a video track, the ``video`` data channel).

Each call is admitted through the session registry like any other session (transport ``webrtc``, or
``webrtc-video``), answered with all host candidates in the SDP (aiortc does not trickle), and then served by its
own task until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from aiortc.sdp import SessionDescription
from starlette.requests import Request
from starlette.responses import Response

from omnigate.gateway.errors import HttpError
from omnigate.gateway.security.client_session import minted_session
from omnigate.gateway.settings import Settings
from omnigate.gateway.state import Gateway
from omnigate.gateway.webrtc.call import TRANSPORT, WebRtcCall
from omnigate.gateway.webrtc.ice import configure_ice
from omnigate.gateway.webrtc.telemetry import WebRtcTelemetry
from omnigate.gateway.webrtc.video_call import TRANSPORT as VIDEO_TRANSPORT
from omnigate.gateway.webrtc.video_call import VideoCall
from omnigate.sessions.registry import SessionLease, SessionLimitReached

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine
    from omnigate.gateway.video_chat.call import VideoChatCall

# A call of any route (the video-chat call module imports this one, so it is named here only for types).
Call: TypeAlias = "WebRtcCall | VideoCall | VideoChatCall"

log = logging.getLogger(__name__)

CALLS_PATH = "/v1/realtime/calls"
VIDEO_CALLS_PATH = "/v1/realtime/video/calls"
SDP_MEDIA_TYPE = "application/sdp"


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


async def realtime_calls_endpoint(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    try:
        offer = await _read_offer(request, gateway.settings.webrtc_max_offer_bytes)
        if gateway.pool is None:
            raise HttpError(
                503, "the engine is not loaded yet", code="not_ready", retry_after_s=gateway.settings.retry_after_s
            )
        lease = _admit(gateway, TRANSPORT)
    except HttpError as exc:
        return exc.response()

    call_id = "rtc_" + secrets.token_hex(12)
    realtime = getattr(request.app.state, "realtime", None)
    call = WebRtcCall(
        call_id,
        gateway,
        lease,
        calls.telemetry,
        realtime,
        request.query_params.get("model"),
        minted=minted_session(request.scope),
    )
    return await _answer(call, offer, calls, CALLS_PATH)


async def video_calls_endpoint(request: Request) -> Response:
    """``POST /v1/realtime/video/calls``: a call that plays generated video (503 ``video_unavailable`` without a
    video model)."""
    gateway: Gateway = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    engine: VideoEngine | None = getattr(request.app.state, "video_engine", None)
    try:
        offer = await _read_offer(request, gateway.settings.webrtc_max_offer_bytes, "video")
        if engine is None:
            raise HttpError(
                503, "this gateway serves no video model (start it with --video-model)", code="video_unavailable"
            )
        lease = _admit(gateway, VIDEO_TRANSPORT)
    except HttpError as exc:
        return exc.response()

    call = VideoCall("rtc_" + secrets.token_hex(12), gateway, lease, calls.telemetry, engine)
    return await _answer(call, offer, calls, VIDEO_CALLS_PATH)


def _admit(gateway: Gateway, transport: str) -> SessionLease:
    try:
        return gateway.registry.acquire(transport)
    except SessionLimitReached as exc:
        code = "shutting_down" if exc.draining else "server_busy"
        raise HttpError(503, str(exc), code=code, retry_after_s=exc.retry_after_s) from None


async def _answer(call: Call, offer: str, calls: WebRtcCalls, path: str) -> Response:
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


async def _read_offer(request: Request, limit: int, kind: str = "audio") -> str:
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
