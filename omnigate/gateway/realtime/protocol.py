"""Client messages of ``/v1/realtime`` from JSON text to the session core's events, with the size limits per type.

A message that is too large, not JSON, or no valid event becomes an :class:`UnreadableEvent` naming the error's code
and, where the message let it be read, the client's ``event_id``; the session answers it and goes on.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnigate.gateway.errors import UNDECODABLE
from omnigate.gateway.json_budget import CODE as JSON_BUDGET_CODE
from omnigate.gateway.json_budget import json_budget_problem
from omnigate.sessions.realtime.client_events import (
    CLIENT_EVENT_TYPES,
    ClientEvent,
    SessionUpdate,
    unknown_session_fields,
)
from omnigate.sessions.realtime.session import RealtimeLimits, UnreadableEvent

_DECODER = msgspec.json.Decoder(ClientEvent)


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


class _SessionEnvelope(msgspec.Struct):
    session: Any = None


def decode_client_event(raw: bytes | str) -> ClientEvent:
    """Parse one client event; raises ``msgspec.DecodeError`` or ``msgspec.ValidationError``. A ``session.update``
    carries the names of its session's fields that are not read (``session.unused_fields`` lists them)."""
    event: ClientEvent = _DECODER.decode(raw)
    if isinstance(event, SessionUpdate):
        # Read again untyped (a session.update is small and rare) to find what the typed read left out.
        session = msgspec.json.decode(raw, type=_SessionEnvelope).session
        event = msgspec.structs.replace(event, unknown_fields=tuple(unknown_session_fields(session)))
    return event


def peek(raw: bytes | str) -> tuple[str | None, str | None]:
    """The ``type`` and ``event_id`` of a message that failed to parse, to word and address its error."""
    try:
        envelope = msgspec.json.decode(raw, type=_Envelope)
    except (*UNDECODABLE, msgspec.ValidationError):
        return None, None
    kind = envelope.type if isinstance(envelope.type, str) else None
    event_id = envelope.event_id if isinstance(envelope.event_id, str) else None
    return kind, event_id


def size_limit(kind: str | None, limits: RealtimeLimits) -> int:
    """The largest message of ``kind`` a session reads."""
    return {
        "input_audio_buffer.append": limits.append_max_bytes * 2,  # base64 of the decoded cap
        "session.update": limits.max_config_bytes,
    }.get(kind or "", limits.max_event_bytes)


def read_client_message(raw: str | bytes, limits: RealtimeLimits) -> ClientEvent | UnreadableEvent:
    """One client text message as an event, or why it is none."""
    problem = json_budget_problem(raw)
    if problem is not None:
        return UnreadableEvent(JSON_BUDGET_CODE, problem)
    size = len(raw)
    if size > limits.max_event_bytes:
        kind, event_id = peek(raw)
        limit = size_limit(kind, limits)
        if size > limit:
            return UnreadableEvent(
                "message_too_large", f"{kind or 'event'} of {size} bytes exceeds {limit} bytes", event_id
            )
    try:
        return decode_client_event(raw)
    except msgspec.ValidationError as exc:
        kind, event_id = peek(raw)
        if kind is None:
            return UnreadableEvent("invalid_event", "each message must be a JSON object with a string 'type'", event_id)
        if kind not in CLIENT_EVENT_TYPES:
            return UnreadableEvent("unknown_event", f"unknown event type {kind!r}", event_id, param="type")
        return UnreadableEvent("invalid_event", f"invalid {kind}: {exc}", event_id)
    except UNDECODABLE:
        return UnreadableEvent("invalid_json", "the message is not valid JSON")
