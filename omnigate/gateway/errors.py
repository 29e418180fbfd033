"""Error shapes each protocol's clients parse."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

# What msgspec raises for JSON it cannot decode: malformed text, invalid UTF-8 inside a string (UnicodeDecodeError),
# or nesting deeper than its recursion limit (RecursionError).
UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    500: "server_error",
}


class HttpError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def response(self) -> Response:
        body = {
            "error": {
                "message": self.message,
                "type": HTTP_ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return Response(msgspec.json.encode(body), self.status, headers, media_type="application/json")


# The codes of the HTTP errors Starlette's router raises itself (an unknown path, a method a route does not take).
_ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


async def routing_error(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (404, 405) in OpenAI's shape, like every other error; ``Allow`` is kept."""
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    response = HttpError(exc.status_code, message, code=_ROUTING_CODES.get(exc.status_code)).response()
    response.headers.update(exc.headers or {})
    return response


def describe_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> tuple[str, str | None]:
    """A client-facing message and the offending field (``$.voice`` -> ``voice``) of a msgspec error."""
    message = str(exc)
    param: str | None = None
    if " - at `$." in message:
        message, _, path = message.partition(" - at `$.")
        param = path.rstrip("`").split("[")[0].split(".")[0] or None
    elif "unknown field `" in message or "missing required field `" in message:
        param = message.split("`")[1]
    return message, param


def json_error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The speech-stream protocol's error event: top-level ``message`` and ``code``."""
    return {"type": "error", "code": code, "message": message, **extra}
