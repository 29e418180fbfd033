"""The client side of ``WS /v1/audio/speech/stream`` that both framework plugins share, without I/O.

A plugin sends ``session.config`` once per connection, then per utterance ``input.text`` as tokens arrive and
``input.done`` at its end; the server segments the text itself. :class:`UtteranceLedger` counts the utterances a
connection has begun and the terminal ``session.done`` of each, so that after ``input.cancel`` a connection is known
to be clean (the server sends nothing of a cancelled utterance after its ``session.done``) before it is reused.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import msgspec

STREAM_PATH = "/v1/audio/speech/stream"

# Error codes after which the same request may succeed later (no free slot, the engine loading, a restart).
RETRYABLE_CODES = frozenset(
    {
        "server_busy",
        "engine_busy",
        "engine_unavailable",
        "not_ready",
        "shutting_down",
        "generation_failed",
        "idle_timeout",
    }
)


def stream_url(base_url: str) -> str:
    """``ws(s)://host:port/v1/audio/speech/stream`` from the server's ``http(s)://host:port`` (a ``/v1`` suffix is
    accepted, as OpenAI clients are given one)."""
    parts = urlsplit(base_url.rstrip("/"))
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"base_url must be http(s)://host:port, not {base_url!r}")
    path = parts.path.removesuffix("/v1")
    return urlunsplit((scheme, parts.netloc, path + STREAM_PATH, "", ""))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class SessionOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``session.config`` asks for; audio is always raw 16-bit mono PCM, streamed as it is generated."""

    voice: str | None = None
    model: str | None = None
    sample_rate: int = 24000
    speed: float = 1.0
    language: str | None = None
    instructions: str | None = None
    split_granularity: Literal["sentence", "clause"] = "sentence"

    def config_event(self) -> str:
        body: dict[str, Any] = {
            "type": "session.config",
            "response_format": "pcm",
            "stream_audio": True,
            "sample_rate": self.sample_rate,
            "speed": self.speed,
            "split_granularity": self.split_granularity,
        }
        for name in ("voice", "model", "language", "instructions"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return msgspec.json.encode(body).decode()


def text_event(text: str) -> str:
    return msgspec.json.encode({"type": "input.text", "text": text}).decode()


INPUT_DONE = '{"type":"input.done"}'
INPUT_CANCEL = '{"type":"input.cancel"}'
SESSION_CLOSE = '{"type":"session.close"}'


class ServerError(Exception):
    """A typed ``error`` event of the server: ``code`` says what, ``retryable`` whether trying again may help."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


class AudioStart(msgspec.Struct, frozen=True):
    utterance_index: int
    sentence_index: int
    sample_rate: int
    sentence_text: str = ""


class SessionDone(msgspec.Struct, frozen=True):
    utterance_index: int
    status: str = "completed"
    error: str | None = None


class _Event(msgspec.Struct):
    type: str = ""


class _Error(msgspec.Struct):
    code: str = "error"
    message: str = ""
    retry_after: float | None = None


ServerEvent = AudioStart | SessionDone | ServerError | None


def parse_event(text: str | bytes) -> ServerEvent:
    """The events a plugin acts on; others (``audio.done``, future additions) are None."""
    kind = msgspec.json.decode(text, type=_Event).type
    if kind == "audio.start":
        return msgspec.json.decode(text, type=AudioStart)
    if kind == "session.done":
        return msgspec.json.decode(text, type=SessionDone)
    if kind == "error":
        error = msgspec.json.decode(text, type=_Error)
        return ServerError(error.code, error.message, error.retry_after)
    return None


class UtteranceLedger:
    """Utterances a connection began and ended: a connection with none open carries nothing stale."""

    def __init__(self) -> None:
        self.begun = 0
        self.ended = 0
        self._collecting = False

    @property
    def open(self) -> int:
        return self.begun - self.ended

    def text_sent(self) -> None:
        if not self._collecting:
            self._collecting = True
            self.begun += 1

    def flushed(self) -> bool:
        """Whether an ``input.done`` ends something (no empty utterances are sent)."""
        was, self._collecting = self._collecting, False
        return was

    def cancelled(self) -> None:
        self._collecting = False

    def done(self) -> None:
        self.ended += 1
