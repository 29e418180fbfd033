"""Plain HTTP routes: liveness, readiness, models, voices, metrics."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnigate.gateway.ops.metrics import CONTENT_TYPE, Metrics
from omnigate.gateway.settings import responder_summary
from omnigate.gateway.state import Gateway

_STARTED = int(time.time())


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def health(request: Request) -> Response:
    """Liveness: the process serves HTTP."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: the engine is loaded, the process admits sessions, and how many more it can take."""
    gw = _gateway(request)
    if gw.pool is None:
        body = {"status": "loading" if gw.load_error is None else "failed", "error": gw.load_error}
        return JSONResponse(body, status_code=503)
    if gw.registry.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    problem = gw.pool.health_problem
    if problem is not None:
        return JSONResponse({"status": "engine_unhealthy", "error": problem}, status_code=503)
    info = gw.pool.info
    free = gw.pool.free_slots
    state: dict[str, str | int] = {
        "engine": info.family,
        "model": info.model,
        "sessions_active": gw.registry.total_active,
        "sessions_max": gw.registry.max_sessions,
        "engine_free_slots": free,
    }
    if free == 0 and gw.settings.admission == "headroom":
        # The engine would refuse a new stream now: a load balancer sends new sessions to another replica.
        return JSONResponse({"status": "no_headroom", **state}, status_code=503)
    return JSONResponse({"status": "ready", **state})


async def models(request: Request) -> Response:
    """OpenAI's model list shape."""
    gw = _gateway(request)
    data = []
    if gw.pool is not None:
        info = gw.pool.info
        data.append(
            {
                "id": info.model,
                "object": "model",
                "created": _STARTED,
                "owned_by": "omnigate",
                "engine": info.family,
                "sample_rate": info.sample_rate,
                "synthetic": info.synthetic,
                # /v1/realtime answers the user with an LLM (serve --llm-url); None: it speaks what it is sent
                "responder": responder_summary(gw.settings),
            }
        )
    return JSONResponse({"object": "list", "data": data})


async def voices(request: Request) -> Response:
    gw = _gateway(request)
    if gw.pool is None:
        return JSONResponse({"voices": [], "default": None})
    info = gw.pool.info
    served = {v.id: v for v in info.voices}
    aliases = [
        {
            "id": alias,
            "name": alias,
            "language": served[voice].language,
            "description": f"OpenAI's voice name, an alias of {voice}",
            "alias_of": voice,
        }
        for alias, voice in info.voice_aliases().items()
    ]
    return JSONResponse(
        {
            # Served voices first; OpenAI's voice names follow, each marked with the served voice it speaks with.
            "voices": [
                {"id": v.id, "name": v.name, "language": v.language, "description": v.description, "alias_of": None}
                for v in info.voices
            ]
            + aliases,
            "default": info.default_voice,
            "uploaded_voices": [],
        }
    )


async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE)
