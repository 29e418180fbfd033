"""``POST /v1/realtime/calls``: an SDP offer in (``application/sdp``), the SDP answer out, as OpenAI's WebRTC flow.
``POST /v1/realtime/video/calls``: the same for generated video (a video track, the ``video`` data channel).

Each call is admitted through the session registry like any other session (transport ``webrtc``, or
``webrtc-video``), answered with all host candidates in the SDP (aiortc does not trickle), and then served by its
own task until it ends (:mod:`omnigate.gateway.webrtc.signalling`, shared with the video-chat route).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from omnigate.gateway.errors import HttpError
from omnigate.gateway.security.client_session import minted_session
from omnigate.gateway.state import Gateway
from omnigate.gateway.webrtc.call import TRANSPORT, WebRtcCall
from omnigate.gateway.webrtc.signalling import WebRtcCalls, admit_call, answer_call, read_offer
from omnigate.gateway.webrtc.video_call import TRANSPORT as VIDEO_TRANSPORT
from omnigate.gateway.webrtc.video_call import VideoCall

if TYPE_CHECKING:
    from omnigate.engines.video.engine import VideoEngine

CALLS_PATH = "/v1/realtime/calls"
VIDEO_CALLS_PATH = "/v1/realtime/video/calls"


async def realtime_calls_endpoint(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    try:
        offer = await read_offer(request, gateway.settings.webrtc_max_offer_bytes)
        if gateway.pool is None:
            raise HttpError(
                503, "the engine is not loaded yet", code="not_ready", retry_after_s=gateway.settings.retry_after_s
            )
        lease = admit_call(gateway, TRANSPORT)
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
    return await answer_call(call, offer, calls, CALLS_PATH)


async def video_calls_endpoint(request: Request) -> Response:
    """``POST /v1/realtime/video/calls``: a call that plays generated video (503 ``video_unavailable`` without a
    video model)."""
    gateway: Gateway = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    engine: VideoEngine | None = getattr(request.app.state, "video_engine", None)
    try:
        offer = await read_offer(request, gateway.settings.webrtc_max_offer_bytes, "video")
        if engine is None:
            raise HttpError(
                503, "this gateway serves no video model (start it with --video-model)", code="video_unavailable"
            )
        lease = admit_call(gateway, VIDEO_TRANSPORT)
    except HttpError as exc:
        return exc.response()

    call = VideoCall("rtc_" + secrets.token_hex(12), gateway, lease, calls.telemetry, engine)
    return await answer_call(call, offer, calls, VIDEO_CALLS_PATH)
