"""Process logging: plain text or one JSON object per line, each record tagged with the session id it belongs to.

The auth middleware gives every WebSocket connection and HTTP request a random session id and sets it in a context
variable; tasks a route starts inherit it, so their records carry it too. Credentials that may appear in a
message (a ``?token=`` query in uvicorn's access lines, a client secret in a subprotocol) are masked before any
handler sees them. The gateway logs no prompts, text or audio; this module cannot stop a careless caller, but it
keeps the fixed fields free of them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import sys
import time
from typing import Any

session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("omnigate_session_id", default=None)
# Set when a WebSocket was refused with an HTTP response (by the auth middleware, or a route's denial response passing
# through it): uvicorn then logs "ASGI callable returned without completing handshake" as an error, although the
# denial response is the ASGI spec's way to refuse and the refusal itself is logged where it is decided.
websocket_denied_var: contextvars.ContextVar[bool] = contextvars.ContextVar("omnigate_ws_denied", default=False)
_DENIAL_NOISE = "ASGI callable returned without completing handshake."
# uvicorn logs a client's protocol violation as a server error with a traceback; it is the client's fault, already
# answered with a typed close (1007), and a client could otherwise flood the error log with tracebacks.
_CLIENT_FAULTS = frozenset({"Invalid UTF-8 sequence received from client."})

_SECRET_PATTERNS = (
    (re.compile(r"([?&](?:token|api_key|key)=)[^&\s\"']+"), r"\1[redacted]"),
    (re.compile(r"(openai-insecure-api-key\.)[^\s,\"']+"), r"\1[redacted]"),
    (re.compile(r"\bek_[A-Za-z0-9_\-]{8,}"), "ek_[redacted]"),
    (re.compile(r"(Bearer\s+)[^\s,\"']+", re.IGNORECASE), r"\1[redacted]"),
)
# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is a structured field.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


def new_session_id() -> str:
    """A random id for one connection or request: unguessable, and unrelated to any credential."""
    return secrets.token_hex(6)


def redact(text: str) -> str:
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class SessionContext(logging.Filter):
    """Adds ``session_id`` to each record and masks credentials in its message. Attach it to handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        if websocket_denied_var.get() and record.msg == _DENIAL_NOISE:
            return False
        if record.msg in _CLIENT_FAULTS:
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.WARNING, "WARNING", None, None
        if not hasattr(record, "session_id"):
            record.session_id = session_id_var.get()
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, session id, ``extra=`` fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and value is not None:
                body[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            body["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(body, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(session_id)s] %(message)s"


def configure_logging(level: str, json_lines: bool) -> None:
    """Send every logger (uvicorn's included: start uvicorn with ``log_config=None``) to stderr through one
    handler, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(SessionContext())
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
