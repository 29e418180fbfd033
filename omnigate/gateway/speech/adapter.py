"""The speech-stream protocol mapped onto a session, whatever carries it (a WebSocket, a WebRTC data channel).

:class:`SpeechInput` turns client messages into session commands (with one typed error per bad message);
the ``*_event`` functions turn session events into the protocol's server events. Audio itself is the transport's
business: binary frames on a WebSocket, the media track over WebRTC.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnigate.codecs.formats import UnsupportedFormat, get_format
from omnigate.gateway.errors import UNDECODABLE, describe_validation_error, json_error
from omnigate.gateway.json_budget import CODE as JSON_BUDGET_CODE
from omnigate.gateway.json_budget import json_budget_problem
from omnigate.gateway.speech.protocol import (
    CLIENT_EVENT_TYPES,
    ClientEvent,
    InputCancel,
    InputDone,
    InputText,
    SessionCloseEvent,
    SessionConfigEvent,
    decode_client_event,
    event_type_of,
    to_session_config,
)
from omnigate.gateway.state import Gateway
from omnigate.sessions.driver import SessionDriver
from omnigate.sessions.messages import (
    AppendText,
    Cancel,
    Close,
    Configure,
    ErrorEvent,
    Flush,
    SegmentDone,
    SegmentStarted,
    UtteranceDone,
)
from omnigate.sessions.speech import ConfigError

# The code of a session ended because a task serving it died (a bug or a fault, not the client's doing).
INTERNAL_ERROR = "internal_error"


class WireOutput(msgspec.Struct):
    """The client's output settings, fixed for the utterances it configured (config changes only when idle)."""

    response_format: str = "wav"
    sample_rate: int | None = None
    stream_audio: bool = False


class SpeechInput:
    """Applies speech-stream client messages to one session driver."""

    def __init__(self, driver: SessionDriver, gateway: Gateway) -> None:
        assert gateway.pool is not None
        self.driver = driver
        self.gateway = gateway
        self.settings = gateway.settings
        self.info = gateway.pool.info
        self.output = WireOutput()
        # True while the transport writes a segment's audio with the current output settings.
        self.writing = False

    def on_text(self, text: str) -> ClientEvent | None:
        """Apply one JSON message; returns the event it carried, or None when it was refused with an error."""
        problem = json_budget_problem(text)
        if problem is not None:
            self.error(JSON_BUDGET_CODE, problem)
            return None
        size = len(text.encode("utf-8"))
        if size > self.settings.ws_max_text_event_bytes and event_type_of(text) != "session.config":
            self.error(
                "message_too_large",
                f"event of {size} bytes exceeds the limit of {self.settings.ws_max_text_event_bytes} bytes",
            )
            return None
        try:
            event = decode_client_event(text)
        except msgspec.ValidationError as exc:
            kind = event_type_of(text)
            if kind is None:
                self.error("invalid_event", "each message must be a JSON object with a string 'type' field")
            elif kind not in CLIENT_EVENT_TYPES:
                self.error("unknown_event", f"unknown event type {kind!r}; expected one of {list(CLIENT_EVENT_TYPES)}")
            else:
                message, param = describe_validation_error(exc)
                self.error("invalid_event", f"invalid {kind}: {message}", param=param)
            return None
        except UNDECODABLE:
            self.error("invalid_json", "message is not valid JSON")
            return None
        if isinstance(event, SessionConfigEvent):
            self._configure(event)
        elif isinstance(event, InputText):
            self.driver.submit(AppendText(event.text))
        elif isinstance(event, InputDone):
            self.driver.submit(Flush())
        elif isinstance(event, InputCancel):
            self.driver.submit(Cancel())
        elif isinstance(event, SessionCloseEvent):
            self.driver.submit(Close())
        return event

    def error(self, code: str, message: str, param: str | None = None) -> None:
        """Queue a non-fatal typed error for the client, in order with the session's other events."""
        self.driver.report(ErrorEvent(code, message, param=param))

    def _configure(self, event: SessionConfigEvent) -> None:
        if self.writing or self.driver.outbox.holds_audio():
            # Audio generated under the current settings has not all been written yet: changing the output format
            # now would apply it to that audio.
            self.error(
                "config_while_busy",
                "session.config is refused while audio of an earlier utterance is still being sent; "
                "wait for session.done and its audio",
            )
            return
        try:
            get_format(event.response_format)
        except UnsupportedFormat as exc:
            self.error("unsupported_format", str(exc), param="response_format")
            return
        try:
            config = to_session_config(
                event,
                self.info,
                served_models=self.gateway.served_models(),
                max_audio_ms=int(self.settings.max_utterance_audio_s * 1000),
                segment_max_chars=self.settings.segment_max_chars,
                segment_max_wait_ms=self.settings.segment_max_wait_ms,
            )
        except ConfigError as exc:
            self.error(exc.code, exc.message, param=exc.param)
            return
        self.driver.submit(Configure(config))
        if self.driver.session.config is config:
            self.output = WireOutput(event.response_format, event.sample_rate, event.stream_audio)


def audio_start_event(event: SegmentStarted, fmt: str, sample_rate: int) -> dict[str, Any]:
    return {
        "type": "audio.start",
        "utterance_index": event.utterance,
        "sentence_index": event.segment,
        "sentence_text": event.text.strip(),
        "format": fmt,
        "sample_rate": sample_rate,
    }


def audio_done_event(event: SegmentDone, total_bytes: int) -> dict[str, Any]:
    return {
        "type": "audio.done",
        "utterance_index": event.utterance,
        "sentence_index": event.segment,
        "total_bytes": total_bytes,
        "error": event.status == "error",
        "status": event.status,
    }


def session_done_event(event: UtteranceDone) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "session.done",
        "utterance_index": event.utterance,
        "total_sentences": event.segments,
        "status": event.status,
    }
    if event.error:
        body["error"] = event.error
    return body


def error_event(event: ErrorEvent) -> dict[str, Any]:
    extra = {"param": event.param} if event.param else {}
    return json_error(event.code, event.message, **extra)


def fail_session(driver: SessionDriver, message: str) -> list[dict[str, Any]]:
    """End a session whose writer died: a fatal ``internal_error``, and what the client still has to be told, as
    wire events: each unfinished utterance's ``session.done`` and the typed error. The audio the dead writer was
    sending is dropped with its ``audio.*`` events; the caller sends these, then closes."""
    driver.fail(INTERNAL_ERROR, message)
    events: list[dict[str, Any]] = []
    while (event := driver.outbox.pop()) is not None:
        if isinstance(event, ErrorEvent):
            events.append(error_event(event))
        elif isinstance(event, UtteranceDone):
            events.append(session_done_event(event))
    return events
