"""Commands into a session and events out of it. Transport-neutral: every wire protocol maps to these."""

from __future__ import annotations

from typing import Literal

import msgspec

from omnigate.sessions.segmenter import SegmenterConfig

UtteranceStatus = Literal["completed", "cancelled", "error", "max_duration", "silence"]


class SessionConfig(msgspec.Struct, frozen=True):
    """Validated, engine-independent speech session settings (the wire adapter fills it)."""

    voice: str | None = None
    speed: float = 1.0
    language: str | None = None
    instructions: str | None = None
    max_audio_ms: int = 120_000
    segmenter: SegmenterConfig = SegmenterConfig()


# ---- commands ----------------------------------------------------------------------------------------------------


class Configure(msgspec.Struct, frozen=True, tag="configure"):
    config: SessionConfig


class AppendText(msgspec.Struct, frozen=True, tag="append_text"):
    text: str


class Flush(msgspec.Struct, frozen=True, tag="flush"):
    """End of the current utterance: synthesize what is buffered; the session stays open."""


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Abort every utterance in progress or queued; the session stays open."""


class Close(msgspec.Struct, frozen=True, tag="close"):
    """End the session after the utterances already flushed have finished."""


Command = Configure | AppendText | Flush | Cancel | Close


# ---- events ------------------------------------------------------------------------------------------------------


class SegmentStarted(msgspec.Struct, frozen=True, tag="segment.started"):
    epoch: int
    utterance: int
    segment: int
    text: str
    sample_rate: int


class MediaChunk(msgspec.Struct, frozen=True, tag="media"):
    """Mono s16le PCM. ``seq`` counts chunks per session, so a transport can detect reordering."""

    epoch: int
    utterance: int
    segment: int
    seq: int
    pcm: bytes
    sample_rate: int

    @property
    def duration_ms(self) -> float:
        return len(self.pcm) / 2 * 1000.0 / self.sample_rate


class SegmentDone(msgspec.Struct, frozen=True, tag="segment.done"):
    epoch: int
    utterance: int
    segment: int
    pcm_bytes: int
    status: UtteranceStatus = "completed"


class UtteranceDone(msgspec.Struct, frozen=True, tag="utterance.done"):
    """The one terminal event of an utterance, whatever ended it."""

    epoch: int
    utterance: int
    segments: int
    status: UtteranceStatus = "completed"
    error: str | None = None


class ErrorEvent(msgspec.Struct, frozen=True, tag="error"):
    """A typed error. ``fatal`` errors are followed by :class:`SessionClosed`."""

    code: str
    message: str
    fatal: bool = False
    param: str | None = None


class SessionClosed(msgspec.Struct, frozen=True, tag="session.closed"):
    """The last event of a session."""

    reason: str
    code: str | None = None


Event = SegmentStarted | MediaChunk | SegmentDone | UtteranceDone | ErrorEvent | SessionClosed
