"""What the chat and transcription clients share: their timeouts, the HTTP client, error typing, bounded reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import msgspec

from omnigate.engines.openai_compat.errors import Service, ServiceError

ERROR_BODY_BYTES = 64 * 1024  # of an HTTP error response, read for the server's message


class ServiceTimeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds a call may wait: to connect; for the first byte (chat: the first token or tool call; transcription:
    the response); between two chunks of a streamed body; for the whole call."""

    connect_s: float = 3.0
    first_byte_s: float = 10.0
    idle_s: float = 10.0
    total_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.connect_s, self.first_byte_s, self.idle_s, self.total_s) <= 0:
            raise ValueError("service timeouts must be positive")


def http_client(connect_s: float, max_connections: int = 256) -> httpx.AsyncClient:
    """One connection pool for a process's service calls. Reads are bounded by the callers' own deadlines, which
    know the difference between the first byte and the gap between chunks."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=connect_s, read=None, write=None, pool=connect_s),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=32),
    )


def endpoint(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


def bearer(api_key: str | None) -> dict[str, str]:
    return {} if not api_key else {"Authorization": f"Bearer {api_key}"}


class _ErrorBody(msgspec.Struct):
    error: dict[str, object] | str | None = None
    detail: object = None
    message: str | None = None


def server_message(body: bytes) -> str:
    """The message in an error body: OpenAI's ``{"error": {"message"}}``, FastAPI's ``detail``, or the text."""
    try:
        parsed = msgspec.json.decode(body, type=_ErrorBody)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace").strip()[:500] or "(empty body)"
    if isinstance(parsed.error, dict) and isinstance(parsed.error.get("message"), str):
        return str(parsed.error["message"])[:500]
    if isinstance(parsed.error, str):
        return parsed.error[:500]
    if parsed.message:
        return parsed.message[:500]
    if parsed.detail is not None:
        return str(parsed.detail)[:500]
    return body.decode("utf-8", "replace").strip()[:500]


class Deadline:
    """The whole call's deadline on the loop's clock, and the limit of each wait within it."""

    def __init__(self, service: Service, total_s: float) -> None:
        self.service = service
        self._loop = asyncio.get_running_loop()
        self._total_s = total_s
        self._end = self._loop.time() + total_s

    def elapsed(self) -> float:
        return self._total_s - (self._end - self._loop.time())

    def within(self, wait_s: float) -> float:
        """The seconds a wait of at most ``wait_s`` may take before the call's own deadline."""
        return max(0.0, min(wait_s, self._end - self._loop.time()))

    def timeout(self, wait_s: float, what: str) -> ServiceError:
        """The error of a wait that ran out: the call's total, or ``what`` (the wait's own limit)."""
        if self._end - self._loop.time() <= 0.001:
            return ServiceError(self.service, "timeout", f"no complete response within {self._total_s:g} s")
        return ServiceError(self.service, "timeout", f"{what} took longer than {wait_s:g} s")


async def send(
    http: httpx.AsyncClient, request: httpx.Request, deadline: Deadline, wait_s: float, what: str
) -> httpx.Response:
    """Send ``request`` and wait for the response's headers (streamed body); every failure is a ServiceError."""
    service = deadline.service
    try:
        async with asyncio.timeout(deadline.within(wait_s)):
            return await http.send(request, stream=True)
    except TimeoutError:
        raise deadline.timeout(wait_s, what) from None
    except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise ServiceError(service, "timeout", f"could not connect to {request.url} in time: {exc}") from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise ServiceError(service, "unavailable", f"cannot reach {request.url}: {exc}") from exc
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise ServiceError(service, "unavailable", f"{request.url} closed the connection: {exc}") from exc
    except httpx.HTTPError as exc:
        raise ServiceError(service, "unavailable", f"request to {request.url} failed: {exc}") from exc


async def next_chunk(
    chunks: AsyncIterator[bytes], deadline: Deadline, wait_s: float, what: str, limit_s: float | None = None
) -> bytes | None:
    """The next piece of a streamed body, None at its end. ``limit_s``: the configured limit a timeout names, when
    the wait is only what is left of it (default ``wait_s``)."""
    try:
        async with asyncio.timeout(deadline.within(wait_s)):
            return await anext(chunks, None)
    except TimeoutError:
        raise deadline.timeout(wait_s if limit_s is None else limit_s, what) from None
    except httpx.HTTPError as exc:
        raise ServiceError(
            deadline.service, "bad_response", f"the connection closed before the response was complete: {exc}"
        ) from exc


async def raise_for_status(response: httpx.Response, deadline: Deadline, wait_s: float) -> None:
    """An HTTP error status becomes ``<service>_error`` with the server's message (its body read, bounded)."""
    if response.status_code < 400:
        return
    body = bytearray()
    chunks = response.aiter_bytes()
    try:
        while len(body) < ERROR_BODY_BYTES:
            chunk = await next_chunk(chunks, deadline, wait_s, "the error body")
            if chunk is None:
                break
            body += chunk
    except ServiceError:
        pass  # the status says enough
    raise ServiceError(
        deadline.service,
        "error",
        f"HTTP {response.status_code}: {server_message(bytes(body[:ERROR_BODY_BYTES]))}",
        status=response.status_code,
    )
