"""Opening a load-test WebSocket, with every way it can fail recorded on the session's trace.

By default the handshake offers ``permessage-deflate`` as browsers and the ``websockets`` library at its defaults
do, so the server is measured with what its real clients negotiate; the answer is recorded on the trace.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from omnigate.loadtest.traces import SessionTrace

CLOSE_WAIT_S = 5.0
MAX_MESSAGE_BYTES = 16 * 2**20
EXTENSIONS_KEY = "websocket_extensions"
NO_EXTENSION = "none"


async def connect_traced(
    url: str,
    connect_timeout_s: float,
    trace: SessionTrace,
    headers: Mapping[str, str] | None = None,
    *,
    compression: bool = True,
) -> ClientConnection | None:
    """Connect with ``headers`` on the handshake, marking the trace connected and recording the extensions the
    server answered; on failure record a typed error on the trace (a refused handshake as ``http_<status>``) and
    return None. ``compression`` offers ``permessage-deflate`` (the library's and browsers' default)."""
    try:
        connection = await connect(
            url,
            additional_headers=headers,
            compression="deflate" if compression else None,
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
    trace.record_negotiated(EXTENSIONS_KEY, negotiated_extensions(connection))
    return connection


def negotiated_extensions(connection: ClientConnection) -> str:
    """The server's ``Sec-WebSocket-Extensions`` answer, or ``none``."""
    response = connection.response
    answer = response.headers.get("Sec-WebSocket-Extensions") if response is not None else None
    return answer or NO_EXTENSION
