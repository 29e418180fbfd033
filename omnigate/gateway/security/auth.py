"""Authentication and per-key admission for every route, HTTP and WebSocket alike, as one pure ASGI middleware.

Credentials, in the order they are looked for:

- ``Authorization: Bearer <API key or client secret>`` (HTTP and WebSocket; what SDKs send), or ``Authorization:
  Api-Key <...>`` (what openpi's robot client sends);
- a WebSocket subprotocol ``openai-insecure-api-key.<client secret or API key>`` (what OpenAI's browser clients
  send, since a browser cannot set WebSocket headers);
- a ``?token=<client secret>`` query parameter (WebSocket only; query strings end up in proxies' logs, so prefer the
  subprotocol).

A client secret (minted by ``POST /v1/realtime/client_secrets``) opens one session: it is accepted on WebSocket
routes and on the HTTP paths of :attr:`RoutePolicy.client_secret_http_paths`, nowhere else. A refused WebSocket gets
an HTTP 401/403/429 denial response before any accept (the ASGI ``websocket.http.response`` extension), or a close
before accept where the server lacks it. Routes read the caller from ``request.state.principal`` or
:data:`~omnigate.gateway.security.credentials.current_principal`.

New routes need nothing here: every path requires a credential unless the policy lists it as open, and every
WebSocket route accepts client secrets. A new public path (static assets of the web client) goes into
:data:`DEFAULT_POLICY`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnigate.gateway.errors import HTTP_ERROR_TYPES
from omnigate.gateway.ops import logging as gateway_logging
from omnigate.gateway.ops.metrics import Metrics
from omnigate.gateway.security.browser_guard import BrowserPolicy, BrowserRefusal, cors_headers
from omnigate.gateway.security.credentials import (
    ANONYMOUS,
    CLIENT_SECRET_PREFIX,
    ApiKeys,
    ClientSecretStore,
    Principal,
    SecretRefused,
    current_principal,
)
from omnigate.gateway.security.ratelimit import KeyedSessionRegistry, KeyRateLimiter, retry_after_header
from omnigate.gateway.state import Gateway

log = logging.getLogger(__name__)

SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
TOKEN_QUERY_PARAMETER = "token"


class RoutePolicy(msgspec.Struct, frozen=True):
    """Which paths need no credential, and where a client secret stands in for an API key."""

    open_paths: frozenset[str] = frozenset({"/health", "/ready", "/", "/favicon.ico"})
    # the web client's static assets
    open_prefixes: tuple[str, ...] = ("/static/", "/web/")
    # HTTP paths that open a session, where a browser presents a client secret (WebSocket routes all accept one)
    client_secret_http_paths: frozenset[str] = frozenset(
        {"/v1/realtime/calls", "/v1/realtime/video/calls", "/v1/video/chat/calls"}
    )
    # HTTP paths that open a session, checked against the per-key session cap before the route runs
    session_http_paths: frozenset[str] = frozenset(
        {"/v1/audio/speech", "/v1/realtime/calls", "/v1/realtime/video/calls", "/v1/video/chat/calls"}
    )
    metrics_path: str = "/metrics"


DEFAULT_POLICY = RoutePolicy()


class Refusal(Exception):
    """Why a request does not reach its route: an HTTP status, a wire code and a message."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="omnigate"'))
        if self.retry_after_s is not None:
            headers.append((b"retry-after", retry_after_header(self.retry_after_s).encode()))
        return headers

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": HTTP_ERROR_TYPES.get(self.status, "invalid_request_error"),
            "param": None,
            "code": self.code,
        }
        return msgspec.json.encode({"error": error})


class _Credential(msgspec.Struct, frozen=True):
    value: str
    source: str  # "header", "subprotocol" or "query"


class AuthMiddleware:
    """Authenticates each HTTP request and WebSocket before its route runs, and applies the per-key limits."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway: Gateway,
        keys: ApiKeys,
        client_secrets: ClientSecretStore,
        metrics: Metrics,
        policy: RoutePolicy = DEFAULT_POLICY,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.keys = keys
        self.client_secrets = client_secrets
        self.metrics = metrics
        self.policy = policy
        self.clock = clock
        self.monotonic = monotonic
        settings = gateway.settings
        self.browser = BrowserPolicy.from_settings(settings)
        self.rate_limiter = (
            KeyRateLimiter(settings.requests_per_s_per_key, settings.request_burst_per_key)
            if settings.requests_per_s_per_key is not None
            else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # Each connection and request runs in its own task, so the id stays with the records logged after the app
        # returns (uvicorn's own lines about this connection) and goes away with the task.
        gateway_logging.session_id_var.set(gateway_logging.new_session_id())
        try:
            cors_origin = self.browser.check(scope)
        except BrowserRefusal as exc:
            await self._refuse(scope, send, Refusal(403, exc.code, exc.message))
            return
        if cors_origin is not None:
            if kind == "http" and scope["method"] == "OPTIONS":
                await send({"type": "http.response.start", "status": 204, "headers": cors_headers(cors_origin, True)})
                await send({"type": "http.response.body", "body": b""})
                return
            send = _with_cors(send, cors_origin)
        if self._is_open(scope):
            await self.app(scope, receive, send)
            return
        try:
            principal, credential = self._authenticate(scope)
            self._check_limits(scope, principal)
            if credential is not None and principal.kind == "client_secret":
                principal = self.client_secrets.consume(credential.value, self.clock())
        except SecretRefused as exc:
            status = 403 if exc.code == "client_secret_used" else 401
            await self._refuse(scope, send, Refusal(status, exc.code, exc.message))
            return
        except Refusal as exc:
            await self._refuse(scope, send, exc)
            return
        await self._serve(scope, receive, send, principal, credential)

    # ---- decisions --------------------------------------------------------------------------------------------

    def _is_open(self, scope: Scope) -> bool:
        path: str = scope["path"]
        policy = self.policy
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            return True  # CORS preflight carries no credentials by design
        if path == policy.metrics_path:
            return not (self.keys.enabled and self.gateway.settings.metrics_require_auth)
        return path in policy.open_paths or path.startswith(policy.open_prefixes)

    def _authenticate(self, scope: Scope) -> tuple[Principal, _Credential | None]:
        credential = _find_credential(scope)
        if not self.keys.enabled:
            return ANONYMOUS, credential
        if credential is None:
            raise Refusal(401, "missing_api_key", "authentication required: send Authorization: Bearer <API key>")
        if credential.value.startswith(CLIENT_SECRET_PREFIX):
            if scope["type"] == "http" and scope["path"] not in self.policy.client_secret_http_paths:
                raise Refusal(403, "client_secret_not_allowed", "a client secret opens sessions only; use an API key")
            return self.client_secrets.check(credential.value, self.clock()), credential
        if credential.source == "query":
            # Query strings end up in proxies' and servers' logs; only a single-use client secret may go there.
            raise Refusal(
                401, "invalid_api_key", "an API key never goes in the URL; send it in the Authorization header"
            )
        principal = self.keys.lookup(credential.value)
        if principal is None:
            raise Refusal(401, "invalid_api_key", "the API key is not valid")
        return principal, credential

    def _check_limits(self, scope: Scope, principal: Principal) -> None:
        key = principal.id if principal.kind != "anonymous" else _client_host(scope)
        if self.rate_limiter is not None:
            wait_s = self.rate_limiter.check(key, self.monotonic())
            if wait_s > 0.0:
                raise Refusal(429, "rate_limited", "too many requests for this API key", retry_after_s=wait_s)
        opens_session = scope["type"] == "websocket" or (
            scope["method"] == "POST" and scope["path"] in self.policy.session_http_paths
        )
        registry = self.gateway.registry
        keyed = opens_session and principal.kind != "anonymous" and isinstance(registry, KeyedSessionRegistry)
        if keyed and isinstance(registry, KeyedSessionRegistry) and registry.key_full(principal.id):
            raise Refusal(
                429,
                "session_limit_per_key",
                f"this API key is at its limit of {registry.max_per_key} concurrent sessions",
                retry_after_s=registry.retry_after_s,
            )

    async def _refuse(self, scope: Scope, send: Send, refusal: Refusal) -> None:
        self.metrics.refusals.labels(refusal.code).inc()
        log.info("refused %s %s: %s", scope["type"], scope["path"], refusal.code)
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": refusal.status, "headers": refusal.headers()})
            await send({"type": "http.response.body", "body": refusal.body()})
        elif "websocket.http.response" in scope.get("extensions", {}):
            gateway_logging.websocket_denied_var.set(True)
            start = {"type": "websocket.http.response.start", "status": refusal.status, "headers": refusal.headers()}
            await send(start)
            await send({"type": "websocket.http.response.body", "body": refusal.body()})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": refusal.code})

    # ---- the admitted request ---------------------------------------------------------------------------------

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, principal: Principal, credential: _Credential | None
    ) -> None:
        scope = _without_credential(scope, credential)
        scope["state"] = {**scope.get("state", {}), "principal": principal}
        offered: list[str] = list(scope.get("subprotocols", []))
        secret_protocol = credential is not None and credential.source == "subprotocol"
        gaps = _ChunkGaps(self.metrics, scope["type"], self.monotonic)
        started = self.monotonic()
        close_code: list[int] = []

        async def send_wrapper(message: Message) -> None:
            kind = message["type"]
            if kind == "websocket.accept" and not message.get("subprotocol") and secret_protocol:
                # A browser that offered subprotocols fails the handshake unless one is selected.
                message = {**message, "subprotocol": _pick_subprotocol(offered, credential)}
            elif kind == "websocket.close":
                close_code.append(int(message.get("code", 1000)))
            elif kind == "websocket.http.response.start":
                gateway_logging.websocket_denied_var.set(True)  # a route's own denial response: logged by the route
            gaps.on_send(message)
            await send(message)

        principal_token = current_principal.set(principal)
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            current_principal.reset(principal_token)
            if scope["type"] == "websocket":
                log.info(
                    "websocket session ended",
                    extra={
                        "path": scope["path"],
                        "principal": principal.id,
                        "duration_s": round(self.monotonic() - started, 3),
                        "close_code": close_code[0] if close_code else None,
                    },
                )


class _ChunkGaps:
    """Feeds the chunk-gap histogram: time between consecutive media sends of one response or WebSocket.

    WebSocket media is a binary frame; a text frame between two (an ``audio.done``) ends the run, so pauses between
    utterances are not counted. An HTTP response's gaps are between consecutive body chunks.
    """

    def __init__(self, metrics: Metrics, transport: str, clock: Callable[[], float]) -> None:
        self._histogram = metrics.chunk_gap.labels(transport)
        self._clock = clock
        self._last: float | None = None

    def on_send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.send":
            if message.get("bytes") is None:
                self._last = None
                return
        elif kind != "http.response.body" or not message.get("body"):
            return
        now = self._clock()
        if self._last is not None:
            self._histogram.observe(now - self._last)
        self._last = now if message.get("more_body", True) else None


def _with_cors(send: Send, origin: str) -> Send:
    """``send`` adding an allowed foreign origin's CORS headers to the response."""

    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *cors_headers(origin, False)]}
        await send(message)

    return send_with_cors


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope.get("headers", [])}


def _find_credential(scope: Scope) -> _Credential | None:
    authorization = _headers(scope).get(b"authorization")
    if authorization is not None:
        scheme, _, value = authorization.decode("latin-1").strip().partition(" ")
        # "Api-Key KEY" is what openpi's websocket client sends
        if scheme.lower() in ("bearer", "api-key") and value.strip():
            return _Credential(value.strip(), "header")
    if scope["type"] != "websocket":
        return None
    for protocol in scope.get("subprotocols", []):
        if protocol.startswith(SUBPROTOCOL_PREFIX) and len(protocol) > len(SUBPROTOCOL_PREFIX):
            return _Credential(protocol.removeprefix(SUBPROTOCOL_PREFIX), "subprotocol")
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=False):
        if name == TOKEN_QUERY_PARAMETER:
            return _Credential(value, "query")
    return None


def _without_credential(scope: Scope, credential: _Credential | None) -> dict[str, Any]:
    """The scope the route sees: no credential in its subprotocols or query string."""
    scope = dict(scope)
    if credential is None or scope["type"] != "websocket":
        return scope
    if credential.source == "subprotocol":
        scope["subprotocols"] = [p for p in scope.get("subprotocols", []) if not p.startswith(SUBPROTOCOL_PREFIX)]
    elif credential.source == "query":
        pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        kept = [(k, v) for k, v in pairs if k != TOKEN_QUERY_PARAMETER]
        scope["query_string"] = urlencode(kept).encode("latin-1")
    return scope


def _pick_subprotocol(offered: list[str], credential: _Credential | None) -> str:
    """The first offered subprotocol that is not the credential; the credential's own entry when it is alone."""
    for protocol in offered:
        if not protocol.startswith(SUBPROTOCOL_PREFIX):
            return protocol
    assert credential is not None
    return SUBPROTOCOL_PREFIX + credential.value


def _client_host(scope: Scope) -> str:
    client = scope.get("client")
    return f"host-{client[0]}" if client else "host-unknown"
