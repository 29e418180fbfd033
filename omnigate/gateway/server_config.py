"""The uvicorn configuration every gateway server uses (``omnigate serve`` and the tests' in-process server).

WebSockets are never compressed. Browsers and most WebSocket libraries offer ``permessage-deflate``; accepting it
would deflate every media frame on the event loop. PCM, Opus and fMP4 do not compress, so the loop that paces
hundreds of sessions would spend its time in zlib for nothing (with clients at their defaults, capacity fell from
hundreds of sessions to under 128). Declining the extension is allowed by RFC 7692: the client then sends and
receives uncompressed frames.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from starlette.types import ASGIApp

from omnigate.gateway.settings import Settings

# uvicorn's ws implementation: sans-I/O websockets on uvloop, the fastest of uvicorn's WebSocket stacks.
WS_IMPLEMENTATION = "websockets-sansio"
# uvicorn's HTTP implementation, named rather than "auto": "auto" silently falls back to pure-Python h11 when
# httptools is missing, which costs every HTTP request and body chunk (benchmarks/http_tts.py measures both).
HTTP_IMPLEMENTATION = "httptools"


def uvicorn_config(app: ASGIApp, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """A uvicorn ``Config`` for the gateway app: uvloop, httptools, sans-I/O websockets, the settings' frame limit
    and no WebSocket compression on any route. ``overrides`` are further ``uvicorn.Config`` arguments (logging,
    shutdown timeout, the HTTP parser of a benchmark); they cannot turn compression back on."""
    options: dict[str, Any] = {
        "loop": "uvloop",
        "http": HTTP_IMPLEMENTATION,
        "ws": WS_IMPLEMENTATION,
        "ws_max_size": settings.ws_max_message_bytes,
        "lifespan": "on",
        **overrides,
        "ws_per_message_deflate": False,
    }
    return uvicorn.Config(app, **options)
