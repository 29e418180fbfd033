"""Opening a load-test WebSocket, with every way it can fail recorded on the session's trace."""

from __future__ import annotations

import time
from collections.abc import Mapping

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from omnigate.loadtest.traces import SessionTrace

CLOSE_WAIT_S = 5.0
MAX_MESSAGE_BYTES = 16 * 2**20


async def connect_traced(
    url: str, connect_timeout_s: float, trace: SessionTrace, headers: Mapping[str, str] | None = None
) -> ClientConnection | None:
    """Connect with ``headers`` on the handshake, marking the trace connected; on failure record a typed error on
    the trace (a refused handshake as ``http_<status>``) and return None."""
    try:
        connection = await connect(
            url,
            additional_headers=headers,
            compression=None,  # PCM does not compress; deflate would only burn CPU on both ends
            proxy=None,
            open_timeout=connect_timeout_s,
            ping_interval=None,
            close_timeout=CLOSE_WAIT_S,
            max_size=MAX_MESSAGE_BYTES,
        )
    except InvalidStatus as exc:
        trace.error(f"http_{exc.response.status_code}", exc.response.body.decode(errors="replace"))
        return None
    except TimeoutError:
        trace.error("connect_timeout")
        return None
    except (OSError, InvalidHandshake, InvalidURI) as exc:
        trace.error("connect_failed", str(exc))
        return None
    trace.connected(time.perf_counter())
    return connection
