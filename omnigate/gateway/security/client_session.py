"""The session configuration minted with a client secret, applied when the browser opens its session.

``POST /v1/realtime/client_secrets`` may carry a ``session``: the configuration the app server chose for the
browser (model, voice, instructions). Its ``type`` names the protocol it configures:

- ``realtime`` (the default, as OpenAI's): the session of ``/v1/realtime``, applied as the first ``session.update``;
- ``speech``: the ``session.config`` of ``/v1/audio/speech/stream``, applied as its first ``session.config``.

It is checked at minting (shape and size), so a secret never carries a configuration its session cannot read. A
browser may change it afterwards like any configuration it sent itself.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.types import Scope

from omnigate.gateway.security.credentials import Principal
from omnigate.gateway.speech.protocol import SessionConfigEvent
from omnigate.sessions.realtime.client_events import SessionPatch

SESSION_TYPES = ("realtime", "speech")


class StoredSessionInvalid(ValueError):
    """A ``session`` that cannot configure the session type it names; ``param`` is the offending field."""

    def __init__(self, message: str, param: str = "session") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_stored_session(session: dict[str, Any], max_bytes: int) -> None:
    """Raise :class:`StoredSessionInvalid` unless ``session`` (with its ``type``) is one its route can apply."""
    size = len(msgspec.json.encode(session))
    if size > max_bytes:
        raise StoredSessionInvalid(f"session is {size} bytes of JSON; the limit is {max_bytes}")
    kind = session.get("type")
    fields = {k: v for k, v in session.items() if k != "type"}
    try:
        if kind == "realtime":
            msgspec.convert(fields, SessionPatch)
        elif kind == "speech":
            msgspec.convert(fields, SessionConfigEvent)
        else:
            raise StoredSessionInvalid(f"session.type must be one of {list(SESSION_TYPES)}", "session.type")
    except msgspec.ValidationError as exc:
        raise StoredSessionInvalid(f"invalid {kind} session: {exc}") from None


def minted_session(scope: Scope) -> dict[str, Any] | None:
    """The session minted with the client secret this request or connection was admitted with, if any."""
    principal = scope.get("state", {}).get("principal")
    return principal.session if isinstance(principal, Principal) else None


def stored_session_event(session: dict[str, Any] | None, kind: str) -> str | None:
    """The client event (JSON text) that applies a minted ``session`` when it configures a ``kind`` session
    (``realtime`` or ``speech``) and names more than its type; else None."""
    if session is None:
        return None
    fields = {k: v for k, v in session.items() if k != "type"}
    if session.get("type") != kind or not fields:
        return None
    if kind == "realtime":
        event: dict[str, Any] = {"type": "session.update", "session": fields}
    else:
        event = {"type": "session.config", **fields}
    return msgspec.json.encode(event).decode()
