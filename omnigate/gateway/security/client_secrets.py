"""``POST /v1/realtime/client_secrets``: mint a short-lived browser credential (OpenAI's request and response shape).

The caller authenticates with an API key; the secret it gets back opens one session (a WebSocket or a WebRTC call)
before ``expires_at``. OpenAI's secrets may open several sessions; ours open one, so a leaked secret is worth at most
one session. The optional ``session`` object (checked, and bounded in size) is kept with the secret and applied when
the session it opens begins (:mod:`omnigate.gateway.security.client_session`). Secrets are bounded in number per
minting key as well as in all, so one key cannot lock out the others.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from omnigate.gateway.errors import HttpError, describe_validation_error
from omnigate.gateway.security.client_session import StoredSessionInvalid, check_stored_session
from omnigate.gateway.security.credentials import ANONYMOUS, ClientSecretStore, Principal, StoreFull
from omnigate.gateway.state import Gateway

MIN_TTL_S = 10  # OpenAI's lower bound for expires_after.seconds


class ExpiresAfter(msgspec.Struct, forbid_unknown_fields=True):
    anchor: Literal["created_at"] = "created_at"
    seconds: Annotated[int, msgspec.Meta(ge=MIN_TTL_S)] | None = None


class ClientSecretRequest(msgspec.Struct, forbid_unknown_fields=True):
    expires_after: ExpiresAfter | None = None
    session: dict[str, Any] | None = None


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes) -> ClientSecretRequest:
    if not body.strip():
        return ClientSecretRequest()
    try:
        return msgspec.json.decode(body, type=ClientSecretRequest)
    except msgspec.ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise HttpError(400, message, code="invalid_request", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec reports invalid UTF-8 in a string as the latter
        raise HttpError(400, "request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise HttpError(400, "request body is nested too deeply", code="invalid_json") from None


async def client_secrets_endpoint(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    store: ClientSecretStore = request.app.state.client_secrets
    settings = gateway.settings
    principal: Principal = getattr(request.state, "principal", ANONYMOUS)
    try:
        try:
            req = _parse(await _read_body(request, settings.http_max_body_bytes))
        except ClientDisconnect:
            return Response(status_code=499)
        ttl_s = settings.client_secret_ttl_s
        if req.expires_after is not None and req.expires_after.seconds is not None:
            ttl_s = float(req.expires_after.seconds)
        if ttl_s > settings.client_secret_max_ttl_s:
            raise HttpError(
                400,
                f"expires_after.seconds may be at most {settings.client_secret_max_ttl_s:g}",
                code="invalid_value",
                param="expires_after",
            )
        session = dict(req.session) if req.session is not None else {}
        session.setdefault("type", "realtime")
        try:
            check_stored_session(session, settings.client_secret_max_session_bytes)
        except StoredSessionInvalid as exc:
            raise HttpError(400, exc.message, code="invalid_value", param=exc.param) from None
        now = time.time()
        try:
            minted = store.mint(principal, ttl_s, now, session)
        except StoreFull as exc:
            raise HttpError(429, str(exc), code="too_many_client_secrets", retry_after_s=ttl_s) from None
    except HttpError as exc:
        return exc.response()
    expires_at = int(minted.expires_at)
    body = {
        "value": minted.value,
        "expires_at": expires_at,
        "session": {
            **session,
            "id": "sess_" + secrets.token_hex(12),
            "object": "realtime.session",
            "expires_at": expires_at,
        },
    }
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"cache-control": "no-store"})
