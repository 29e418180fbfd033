"""The engine-side state of one duplex session: its slot, its input audio and the credit its consumer granted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec


class DuplexFrame(msgspec.Struct, frozen=True):
    """One tick of one session: 80 ms of the model's audio (s16le mono at ``sample_rate``) and its text token.

    ``listening`` is the model's own turn-taking signal (its text stream says it is listening, not speaking);
    ``input_ms`` is how much of the user's audio the tick consumed (0 when the session was clocked with silence).
    """

    tick: int
    pcm: bytes
    sample_rate: int
    text_token: int
    text: str
    listening: bool
    input_ms: float


FrameSink = Callable[[DuplexFrame], None]
SessionEnd = Callable[[str, str], None]
"""Told, with a typed error code and a message, that the engine ended a session on its own (its step failed, or the
engine serving it is gone); called on the session's event loop, at most once, and no frame follows."""


class DuplexFull(Exception):
    """Every duplex slot is taken; the caller refuses the session with a retry hint."""

    def __init__(self, max_sessions: int, retry_after_s: float) -> None:
        super().__init__(f"all {max_sessions} duplex sessions are in use")
        self.max_sessions = max_sessions
        self.retry_after_s = retry_after_s


class DuplexClosed(Exception):
    """The engine is shutting down and admits nothing."""


class DuplexUnavailable(Exception):
    """The engine serving duplex sessions cannot be reached now (its process is restarting); the caller refuses the
    session with a retry hint."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class DuplexSession:
    """A live session: the engine's lock guards every field the event loop and the clock thread share."""

    id: int
    slot: int
    seed: int
    sink: FrameSink
    loop: asyncio.AbstractEventLoop
    max_input_bytes: int
    credit_frames: int
    on_end: SessionEnd | None = None
    pending: bytearray = field(default_factory=bytearray)
    fresh: bool = True
    closed: bool = False
    ticks: int = 0
